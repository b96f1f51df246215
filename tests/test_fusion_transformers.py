"""The batched calls of transformers (issue 48): attention, embeddings and the calls that
name a member's dimensions give each member its own outputs and gradients, without
vmap, in double precision (where another order of the same sums rounds far below the
tolerance)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from cerebro_automl.fusion.batched import BatchedLayers
from cerebro_automl.fusion.stacked import StackedModels


def _members(build, k=3):
    models = []
    for seed in range(k):
        torch.manual_seed(seed)
        model = build().double()
        with torch.no_grad():  # no initial zeros or ones, which any order keeps exact
            for p in model.parameters():
                if p.is_floating_point():
                    p.add_(torch.randn_like(p) * 0.1)
        models.append(model)
    return models


class _Forward(nn.Module):
    """A linear layer, a weight of 4 x 6, a vector of 6 and a class token, and a forward given."""

    def __init__(self, forward):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.weight = nn.Parameter(torch.randn(6, 4))
        self.vector = nn.Parameter(torch.randn(6))
        self.token = nn.Parameter(torch.randn(1, 1, 6))
        self._forward = forward

    def forward(self, x):
        return self._forward(self, x)


class Attention(nn.Module):  # timm's ViT attention
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


class ViT(nn.Module):  # timm's ViT, small: patch embedding, class token, pre-norm blocks
    def __init__(self, dim: int = 8, depth: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm1": nn.LayerNorm(dim, eps=1e-6), "attn": Attention(dim, heads),
                           "norm2": nn.LayerNorm(dim, eps=1e-6),
                           "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))})
            for _ in range(depth)
        )  # fmt: skip
        self.norm, self.head = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, 3)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = x + block["attn"](block["norm1"](x))
            x = x + block["mlp"](block["norm2"](x))
        return self.head(self.norm(x)[:, 0])


class HandAttention(nn.Module):  # attention written out: chunk, matmul, softmax, a causal mask, mean pooling
    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, 2)
        self.register_buffer("causal", torch.tril(torch.ones(4, 4, dtype=torch.bool)))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        scores = scores.masked_fill(~self.causal, float("-inf")) if False else scores  # noqa: SIM108 (no branch on values)
        attended = torch.softmax(scores, dim=-1) @ v
        return self.out(attended.mean(dim=1))


class MaskedAttention(nn.Module):  # heads, and an additive mask of the batch's own: [rows, 1, 1, keys]
    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.attn, self.out = Attention(dim, 2), nn.Linear(dim, 2)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.attn.qkv(x).reshape(B, N, 3, 2, C // 2).permute(2, 0, 3, 1, 4).unbind(0)
        mask = x.mean(-1)[:, None, None, :]
        return self.out(F.scaled_dot_product_attention(q, k, v, mask).transpose(1, 2).reshape(B, N, C))


class Sequences(nn.Module):  # BERT's embeddings: words (a padding row), positions from a buffer, LayerNorm
    def __init__(self, vocab: int = 11, dim: int = 6, length: int = 5) -> None:
        super().__init__()
        self.words = nn.Embedding(vocab, dim, padding_idx=0)
        self.positions = nn.Embedding(length, dim)
        self.register_buffer("position_ids", torch.arange(length).unsqueeze(0))
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, 2)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids):
        length = ids.shape[1]
        x = self.norm(self.words(ids) + self.positions(self.position_ids[:, :length]))
        x = x + self.attn(x)
        return self.head(x[:, 0])


def _images(rows=4):
    return torch.randn(rows, 3, 8, 8, dtype=torch.float64)


def _tokens(rows=4, length=5):
    ids = torch.randint(0, 11, (rows, length), generator=torch.Generator().manual_seed(0))
    ids[:, -1] = 0  # padding
    return ids


_MODELS = {
    "vit": (ViT, _images),
    "hand-written-attention": (HandAttention, lambda: torch.randn(3, 4, 6, dtype=torch.float64)),
    "embeddings-and-attention": (Sequences, _tokens),
    "split-and-stack": (lambda: _Forward(lambda m, x: torch.stack(m.fc(x).split([2, 4], dim=-1)[1].unbind(-1), 0)
                                         .sum(0)), lambda: torch.randn(5, 6, dtype=torch.float64)),
    "cat-of-a-value-and-the-batch": (lambda: _Forward(lambda m, x: torch.cat([m.fc(x), x], dim=1).log_softmax(-1)),
                                     lambda: torch.randn(5, 6, dtype=torch.float64)),
    "a-weight-on-either-side-of-matmul": (lambda: _Forward(lambda m, x: (x @ m.weight).permute(1, 0) @ m.fc(x)
                                                           @ m.vector), lambda: torch.randn(5, 6, dtype=torch.float64)),
    "a-vector-weight-first": (lambda: _Forward(lambda m, x: m.vector @ m.fc(x).transpose(0, 1)),
                              lambda: torch.randn(5, 6, dtype=torch.float64)),
    "indexing-and-sum": (lambda: _Forward(lambda m, x: m.fc(x)[..., 1:4, None].sum((1, -1)) + m.fc(x)[:, 0].mean()),
                         lambda: torch.randn(5, 3, 6, dtype=torch.float64)),
    "a-token-before-the-batch": (lambda: _Forward(lambda m, x: torch.cat([m.token.expand(x.size(0), 1, 6), x], 1)
                                                  .softmax(1)), lambda: torch.randn(5, 2, 6, dtype=torch.float64)),
    "a-vector-expanded-to-more-dimensions": (lambda: _Forward(lambda m, x: m.fc(x) * m.vector.expand(x.size(0), 3, 6)),
                                             lambda: torch.randn(5, 3, 6, dtype=torch.float64)),
    "attention-masked-by-the-batch": (MaskedAttention, lambda: torch.randn(3, 4, 6, dtype=torch.float64)),
    "comparisons-of-values": (lambda: _Forward(lambda m, x: m.fc(x) * (x != 0) + (x[..., :1] == 0) * 1.0
                                               + (m.fc(x) > 0.1) * 2.0 + ~(x < 0) * 0.5),
                              lambda: torch.randn(5, 3, 6, dtype=torch.float64).clamp(min=-0.5).round()),
    "reductions-keeping-dimensions": (lambda: _Forward(lambda m, x: m.fc(x).sum(dim=None, keepdim=True) * m.fc(x)
                                                       + x.mean(dim=None, keepdim=True)),
                                      lambda: torch.randn(5, 3, 6, dtype=torch.float64)),
    "squeeze-of-several-dimensions": (lambda: _Forward(lambda m, x: m.fc(x)[:, :1, None].squeeze((1, 2))),
                                      lambda: torch.randn(5, 3, 6, dtype=torch.float64)),
    "an-in-place-sum-then-its-value": (lambda: _Forward(_in_place_sum), lambda: torch.randn(5, 6, dtype=torch.float64)),
    "a-branch-on-being-a-tensor": (lambda: _Forward(lambda m, x: m.fc(x) * 2 if isinstance(x, torch.Tensor) else x),
                                   lambda: torch.randn(5, 6, dtype=torch.float64)),
}


def _in_place_sum(m, x):
    h = m.fc(x)
    h += x  # a ResNet's out += identity
    return h * 2


def _view_then_in_place(m, x):
    h = m.fc(x)
    g = h[..., :2]  # a view: doubled too
    h *= 2
    return torch.cat([g, h], -1)


@pytest.mark.parametrize("forward", [
    _view_then_in_place,
    lambda m, x: m.fc(x).sum(dim=()) * m.fc(x),
    lambda m, x: F.softmax(m.fc(x)),
    lambda m, x: m.fc(x) if x[0, 0] in x else x,
], ids=["a-view-of-a-value-changed-in-place", "an-empty-tuple-of-dimensions", "softmax-without-a-dimension",
        "membership"])
@pytest.mark.filterwarnings("ignore:Implicit dimension choice for softmax")
def test_what_a_replay_could_get_wrong_goes_through_vmap(forward):
    assert BatchedLayers.of(_Forward(forward).double(), torch.randn(5, 6, dtype=torch.float64)) is None


def test_a_multihead_attention_whose_weight_the_forward_computes_goes_through_vmap():
    """A merged LoRA update of the in-projection: not one of the model's weights as they lie."""
    def forward(m, x):
        weight = m.attn.in_proj_weight + m.extra
        return F.multi_head_attention_forward(
            x, x, x, 6, 2, weight, m.attn.in_proj_bias, None, None, False, 0.0, m.attn.out_proj.weight,
            m.attn.out_proj.bias, training=True, need_weights=False)[0]  # fmt: skip

    model = _Forward(forward)
    model.attn, model.extra = nn.MultiheadAttention(6, 2), nn.Parameter(torch.zeros(18, 6))
    assert BatchedLayers.of(model, torch.randn(4, 3, 6)) is None


def test_attention_dropout_on_the_shared_batch_is_drawn_too():
    """Attention of the input batch itself (queries, keys and values every member shares)."""
    model = _Forward(lambda m, x: m.fc(F.scaled_dot_product_attention(x, x, x, dropout_p=0.5)))
    x = torch.randn(3, 4, 6)
    torch.manual_seed(0)
    outputs = []
    for k in (2, 3):
        torch.manual_seed(5)
        outputs.append(StackedModels([model] * k).batched_forward(x))
    assert torch.equal(outputs[0][0], outputs[1][2])
    with torch.no_grad():
        undropped = model.fc(F.scaled_dot_product_attention(x, x, x))
        assert not torch.allclose(outputs[0][0], undropped)


def _check(models, stacked, x):
    """Each member's output and gradients in the batched calls are its own model's."""
    for p in stacked.params.values():
        p.grad = None
    out = stacked.batched_forward(x)
    assert out is not None, "went through vmap"
    out.pow(2).sum().backward()
    for i, model in enumerate(models):
        model.zero_grad()
        own = model(x)
        own.pow(2).sum().backward()
        torch.testing.assert_close(out[i], own, msg=lambda m, i=i: f"member {i}: {m}")
        for name, p in model.named_parameters():
            if p.grad is None:
                assert stacked.params[name].grad is None or not stacked.params[name].grad[i].any(), name
                continue
            torch.testing.assert_close(stacked.params[name].grad[i], p.grad,
                                       msg=lambda m, at=f"{name} of member {i}": f"{at}: {m}")  # fmt: skip


@pytest.mark.parametrize("name", list(_MODELS))
def test_each_member_gets_its_own_outputs_and_gradients(name):
    build, data = _MODELS[name]
    models = _members(build)
    stacked = StackedModels(models)
    x = data()
    assert stacked.layers_for(x) is not None
    _check(models, stacked, x)


@pytest.mark.parametrize("name", ["vit", "embeddings-and-attention"])
def test_in_evaluation_without_autograd_too(name):
    build, data = _MODELS[name]
    models = [m.eval() for m in _members(build)]
    stacked = StackedModels(models)
    x = data()
    with torch.no_grad():
        out = stacked.batched_forward(x)
        for i, model in enumerate(models):
            torch.testing.assert_close(out[i], model(x))


def test_a_padding_rows_gradient_stays_zero_for_every_member():
    models = _members(Sequences)
    stacked = StackedModels(models)
    stacked.batched_forward(_tokens()).pow(2).sum().backward()
    grad = stacked.params["words.weight"].grad
    assert not grad[:, 0].any() and grad[:, 1:].any()


def test_a_forward_that_branches_on_its_batch_size_is_recorded_for_each_size():
    def forward(m, x):
        h = m.fc(x)
        return h[:1] * 2 if x.shape[0] > 4 else h.transpose(0, 1)

    models = _members(lambda: _Forward(forward))
    stacked = StackedModels(models)
    for rows in (6, 3, 6):
        x = torch.randn(rows, 6, dtype=torch.float64)
        _check(models, stacked, x)
    assert len(stacked._layers) == 2


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap's, for its loop over the attention
def test_the_same_outputs_as_vmap_in_single_precision():
    """What a fused unit trains with: the batched calls against vmap's batching of the
    same model, up to float rounding."""
    stacked = StackedModels([ViT() for _ in range(3)])
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(stacked.batched_forward(x), stacked.call(lambda model, x: model(x), x))


class _MultiHead(nn.Module):
    """``nn.MultiheadAttention`` as people call it: self-attention, or a query attending to
    a projection of itself (keys and values of other sizes); its weights used too."""

    def __init__(self, batch_first=True, need_weights=True, average=True, cross=False):
        super().__init__()
        extra = {"kdim": 4, "vdim": 5} if cross else {}
        self.attn = nn.MultiheadAttention(6, 2, batch_first=batch_first, **extra)
        self.keys, self.values = nn.Linear(6, 4), nn.Linear(6, 5)
        self.need_weights, self.average, self.cross = need_weights, average, cross

    def forward(self, x):
        keys, values = (self.keys(x), self.values(x)) if self.cross else (x, x)
        out, weights = self.attn(x, keys, values, need_weights=self.need_weights,
                                 average_attn_weights=self.average)  # fmt: skip
        return out if weights is None else out + weights.sum() * 0.1


@pytest.mark.parametrize("build, shape", [
    (lambda: _MultiHead(), (3, 4, 6)),
    (lambda: _MultiHead(batch_first=False), (4, 3, 6)),
    (lambda: _MultiHead(need_weights=False), (3, 4, 6)),
    (lambda: _MultiHead(average=False), (3, 4, 6)),
    (lambda: _MultiHead(cross=True), (3, 4, 6)),
    (lambda: _MultiHead(), (4, 6)),
    (lambda: nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0, batch_first=True), (3, 4, 6)),
    (lambda: nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0, batch_first=True, norm_first=True,
                                        activation="gelu"), (3, 4, 6)),  # fmt: skip
], ids=["self-attention", "sequence-first", "without-weights", "weights-of-each-head", "other-key-and-value-sizes",
        "unbatched", "transformer-encoder-layer", "pre-norm-encoder-layer"])
def test_multihead_attention_gives_each_member_its_own_outputs_and_gradients(build, shape):
    models = _members(build)
    stacked = StackedModels(models)
    x = torch.randn(shape, dtype=torch.float64)
    assert stacked.layers_for(x) is not None
    _check(models, stacked, x)


@pytest.mark.parametrize("need_weights", [False, True], ids=["encoder-layer", "weights-asked-for"])
def test_attention_dropout_in_training_is_one_mask_for_every_member_and_off_in_evaluation(need_weights):
    """Alone, each member draws its own mask inside the attention; fused, the members
    share the group's draws, as for every dropout: members with the same weights compute
    the same, and a member's draws do not depend on which members share its group."""
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    torch.manual_seed(0)
    if need_weights:
        layer = _MultiHead().double()
        layer.attn.dropout = 0.5
    else:
        layer = nn.TransformerEncoderLayer(6, 2, 12, batch_first=True).double()  # dropout 0.1
    outputs = []
    for k in (2, 3):
        stacked = StackedModels([layer] * k)
        torch.manual_seed(5)
        outputs.append(stacked.batched_forward(x))
    two, three = outputs
    assert torch.equal(two[0], two[1]) and torch.equal(three[0], three[2])
    torch.testing.assert_close(two[0], three[0])
    torch.manual_seed(6)
    assert not torch.allclose(StackedModels([layer] * 2).batched_forward(x)[0], two[0])  # dropout is on
    layer.eval()
    with torch.no_grad():
        torch.testing.assert_close(StackedModels([layer] * 2).batched_forward(x)[1], layer(x))
    models = [m.eval() for m in _members(lambda: nn.TransformerEncoderLayer(6, 2, 12, batch_first=True))]
    stacked = StackedModels(models)
    with torch.no_grad():
        out = stacked.batched_forward(x)
        for i, model in enumerate(models):
            torch.testing.assert_close(out[i], model(x))


class _Bert(nn.Module):
    """A HuggingFace BERT classifier as a module that gives its logits."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=8, num_labels=3,
                            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)  # fmt: skip
        self.bert = BertForSequenceClassification(config)

    def forward(self, ids):
        return self.bert(input_ids=ids).logits


def _bert_tokens(rows=4):
    return torch.randint(1, 50, (rows, 8), generator=torch.Generator().manual_seed(0))


def test_a_huggingface_bert_gives_each_member_its_own_outputs_and_gradients():
    """Its embeddings (a gather of a buffer, positions made with arange), masks made of
    its own and SDPA attention, all as batched calls."""
    models = _members(lambda: _Bert(dropout=0.0))
    stacked = StackedModels(models)
    x = _bert_tokens()
    assert stacked.layers_for(x) is not None
    _check(models, stacked, x)


def test_dropout_inside_attention_is_one_mask_for_every_member():
    """In training, BERT's attention drops weights: every member applies one mask of a
    member's shape, so members with the same weights compute the same, and a member's
    draws do not depend on which members share its group."""
    torch.manual_seed(0)
    bert = _Bert(dropout=0.1).double()
    x = _bert_tokens()
    outputs = []
    for k in (2, 3):
        stacked = StackedModels([bert] * k)
        assert stacked.layers_for(x) is not None
        torch.manual_seed(5)
        outputs.append(stacked.batched_forward(x))
    (two, three) = outputs
    assert torch.equal(two[0], two[1]) and torch.equal(three[0], three[2])
    torch.testing.assert_close(two[0], three[0])
    torch.manual_seed(6)
    assert not torch.allclose(StackedModels([bert] * 2).batched_forward(x)[0], two[0])  # dropout is on


@pytest.mark.parametrize("forward", [
    lambda m, x: m.fc(x + torch.ones(6, dtype=x.dtype)),
    lambda m, x: m.fc(x) + torch.arange(x.size(0), dtype=x.dtype, device=x.device).unsqueeze(1),
], ids=["a-tensor-of-its-own", "a-tensor-of-a-size"])
def test_a_tensor_the_forward_makes_of_numbers_and_sizes_is_a_constant_of_the_replay(forward):
    models = _members(lambda: _Forward(forward))
    stacked = StackedModels(models)
    for rows in (5, 2):
        x = torch.randn(rows, 6, dtype=torch.float64)
        assert stacked.layers_for(x) is not None
        _check(models, stacked, x)
