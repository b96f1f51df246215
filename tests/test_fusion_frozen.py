"""Fusion over a frozen base (issue 48): LoRA-style members that share their frozen
weights (one tensor each, as a worker keeps a base once) keep them unstacked, and the
batched calls run the frozen layers once for every member, the members stacked along
the batch; each member still computes its own outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cerebro_automl.fusion.stacked import StackedModels


def _share_frozen(models):
    """Every member holds the first member's frozen parameters, as a worker's kept base."""
    frozen = {name: p for name, p in models[0].named_parameters() if not p.requires_grad}
    for model in models[1:]:
        for name, p in frozen.items():
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = p
    return models


class _Lora(nn.Module):
    """A frozen linear layer with a trainable low-rank update, as peft's."""

    def __init__(self, features: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(features, features)
        self.A, self.B = nn.Linear(features, rank, bias=False), nn.Linear(rank, features, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + self.B(self.A(x)) * 0.5


class _Tagger(nn.Module):
    """Frozen embeddings and LayerNorm, frozen attention projections with LoRA, a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(20, 8, padding_idx=0), nn.LayerNorm(8)
        self.qkv = nn.Linear(8, 24)
        self.lora = _Lora(8)
        self.head = nn.Linear(8, 3)
        for module in (self.embed, self.norm, self.qkv):
            module.requires_grad_(False)

    def forward(self, ids):
        x = self.norm(self.embed(ids))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.lora(nn.functional.scaled_dot_product_attention(q, k, v))
        return self.head(x.mean(1))


def _members(build, k=3):
    models = []
    for seed in range(k):
        torch.manual_seed(seed)
        model = build().double()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # LoRA's B starts at 0 in peft: not here
        models.append(model)
    return _share_frozen(models)


def _ids(rows=4, length=6):
    ids = torch.randint(1, 20, (rows, length), generator=torch.Generator().manual_seed(0))
    ids[:, -1] = 0
    return ids


def _check_each_member(models, stacked, out):
    out.pow(2).sum().backward()
    for i, model in enumerate(models):
        model.zero_grad()
        own = model(_ids())
        own.pow(2).sum().backward()
        torch.testing.assert_close(out[i], own, msg=lambda m, i=i: f"member {i}: {m}")
        for name, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(stacked.params[name].grad[i], p.grad, msg=lambda m, n=name: f"{n}: {m}")


def test_the_frozen_base_is_one_tensor_and_each_member_gets_its_own_outputs_and_gradients():
    models = _members(_Tagger)
    stacked = StackedModels(models)
    frozen = {n for n, p in models[0].named_parameters() if not p.requires_grad}
    assert set(stacked.shared) == frozen
    assert not frozen & set(stacked.params)
    assert all(stacked.shared[n] is models[2].get_parameter(n) for n in frozen)  # not copied
    assert stacked.layers_for(_ids()) is not None
    _check_each_member(models, stacked, stacked.batched_forward(_ids()))


def test_through_vmap_too():
    models = _members(_Tagger)
    stacked = StackedModels(models)
    _check_each_member(models, stacked, stacked.call(lambda model, x: model(x), _ids()))


def test_the_frozen_layers_on_the_shared_batch_run_once_for_every_member():
    """The embedding, LayerNorm and the frozen projection see the shared batch: one call
    each, on its rows alone (not k times the rows)."""
    from torch.profiler import profile

    stacked = StackedModels(_members(_Tagger, k=4))
    stacked.batched_forward(_ids())  # recorded at the first call
    with profile(record_shapes=True) as trace:
        stacked.batched_forward(_ids())
    shapes = {tuple(map(tuple, e.input_shapes[:1])) for e in trace.key_averages(group_by_input_shape=True)
              if e.key == "aten::embedding"}  # fmt: skip
    assert shapes == {((20, 8),)}  # the one table, not 4 stacked


def test_members_that_do_not_share_a_frozen_tensor_stack_it():
    models = [m for m in _members(_Tagger)]
    models[1].qkv.weight = nn.Parameter(models[1].qkv.weight.detach().clone(), requires_grad=False)
    stacked = StackedModels(models)
    assert "qkv.weight" in stacked.params and "qkv.bias" in stacked.shared
    _check_each_member(models, stacked, stacked.batched_forward(_ids()))


class _PeftBert(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's call
def test_peft_lora_members_of_one_bert_share_its_base_and_each_gets_its_own_gradients():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=8, num_labels=3)  # fmt: skip
    base = BertForSequenceClassification(config).double()
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        lora = LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], task_type="SEQ_CLS")
        peft = get_peft_model(copy.deepcopy(base), lora)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)  # peft starts B at 0, where every member computes the base alone
        models.append(_PeftBert(peft).eval())  # no dropout: each member's own forward is the reference
    _share_frozen(models)
    stacked = StackedModels(models)
    assert any("word_embeddings" in n for n in stacked.shared) and not any("lora" in n for n in stacked.shared)
    assert stacked.layers_for(_ids()) is not None
    _check_each_member(models, stacked, stacked.batched_forward(_ids()))
    # Its embeddings (words, positions and token types from buffers every member holds alike)
    # are looked up once for all members: in the one tables, with the batch's indices alone.
    from torch.profiler import profile

    with profile(record_shapes=True) as trace:
        stacked.batched_forward(_ids())
    lookups = [e.input_shapes[:2] for e in trace.events() if e.name == "aten::embedding"]
    assert len(lookups) == 3 and all(len(ids) == 2 for _, ids in lookups), lookups
