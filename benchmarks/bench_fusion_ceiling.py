"""What fusion can gain at most, on the CPU: one unfused model at batch k·b against k
unfused models at batch b, the same samples, for the models that people tune.

    python benchmarks/bench_fusion_ceiling.py [--rounds 3] [--steps N] [--models resnet18 vit ...]
                                              [--no-fused] [--quick] [--out benchmarks/results]

Fusion turns k models at batch b into one batched model; it can never be faster
than one model at batch k·b, which does the same arithmetic in the same kernels
with one set of weights (HFTA, Wang et al., MLSys 2021). So the **ceiling** of
fusion for a model is

    (seconds of k models at batch b, one after another) / (seconds of one model at batch k·b)

over the same training steps (forward, backward and AdamW step; ``--steps`` per side
per round, by default 1 to 60 by model, about 1 to 5 s a side), one torch thread, in
one process. "One after another on one thread" is what k
co-located workers amount to on this CPU: with one core per worker, k workers
side by side run k·b samples in k single-core steps; on 2 cores, 8 co-located
workers time-share the cores, which adds context switches and cache misses on top
(it can only lower the unfused side's speed, so the sequential figure is the
co-located side at its best and the ceiling a lower bound of what co-location
leaves). Fused training runs one group per worker, one core each, so both sides are
compared per core. The two sides alternate, round by round (the first side alternates
too), and each figure is the median of ``--rounds``; the ratio is the median of the
rounds' ratios, with their lowest and highest.

The fused unit at batch k·b still steps k sets of weights: "ceiling with k optimizer
steps" adds (k-1) AdamW steps (timed on the unfused side) to the big model's time,
the tighter bound for fusion of a model whose optimizer step counts.

Models (3x32x32 images unless said; the timm ones in plain torch with timm's layers,
since timm needs torchvision, which cannot live beside this CPU torch):

* ``cnn``: bench_fusion's MNIST-1D 1-D CNN, width 32, batch 64: the reference;
* ``resnet18``: timm ``resnet18``'s shape: 7x7 stem, max pool, BasicBlocks [2, 2, 2, 2],
  BatchNorm2d, residual adds, adaptive average pool;
* ``resnet10t``: timm ``resnet10t``'s: tiered 3-conv stem (24, 32, 64), BasicBlocks
  [1, 1, 1, 1], average-pool downsampling;
* ``vit``: a timm-style ViT: patch 4, depth 4, dim 192, 3 heads, LayerNorm, GELU,
  ``scaled_dot_product_attention``, class token;
* ``bert``: HuggingFace ``BertForSequenceClassification`` from a ``BertConfig``
  (hidden 256, 4 layers, 4 heads, intermediate 1024, sequence 128, 2 labels, no download),
  in a module whose forward gives the logits;
* ``bert-lora``: the same BERT, one seeded base for every configuration (a stand-in for
  a checkpoint), with peft LoRA adapters (r 8) on the attention's query and value: the
  members of a group share the frozen base, which it does not stack;
* ``timm-resnet10t``, ``timm-resnet18``, ``timm-vit``: timm's own models, where timm
  can be imported (a GPU machine's torch), not by default.

Unless ``--no-fused``, each model's ``fuse=k`` path is also timed: one group's unit
(``train_group``, as ``compare_fused_unit.py`` calls it) against the same members
trained one by one through the same loop, same steps, and which path the group took
(the batched calls, ``vmap``, or one by one with the reason). Results:
``fusion_ceiling.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))


# --- the models ---------------------------------------------------------------------------------


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    """timm's (and torchvision's) BasicBlock: two 3x3 convolutions, BatchNorm, a residual add."""

    def __init__(self, cin: int, cout: int, stride: int, avg_down: bool) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, cout, 3, stride)
        self.conv2, self.bn2 = _conv_bn(cout, cout, 3)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            if avg_down:  # resnet10t's: average pool, then a 1x1 convolution of stride 1
                pool = nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False) if stride > 1 else nn.Identity()
                self.downsample = nn.Sequential(pool, *_conv_bn(cin, cout, 1))
            else:
                self.downsample = nn.Sequential(*_conv_bn(cin, cout, 1, stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + shortcut)


class ResNet(nn.Module):
    """timm's ResNet with BasicBlocks: ``layers`` blocks per stage, 64-128-256-512 channels."""

    def __init__(self, layers: tuple[int, ...], tiered_stem: bool, classes: int = 10) -> None:
        super().__init__()
        if tiered_stem:  # "deep_tiered", stem width 32: 24, 32, then 64 channels
            self.stem = nn.Sequential(*_conv_bn(3, 24, 3, 2), nn.ReLU(), *_conv_bn(24, 32, 3), nn.ReLU(),
                                      nn.Conv2d(32, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))  # fmt: skip
        else:
            self.stem = nn.Sequential(*_conv_bn(3, 64, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks: list[nn.Module] = []
        cin = 64
        for stage, count in enumerate(layers):
            cout = 64 * 2**stage
            for i in range(count):
                blocks.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1, avg_down=tiered_stem))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """A pre-norm transformer block, as timm's ViT: LayerNorm, attention, LayerNorm, GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A small timm-style ViT on 32x32 images: patch 4 (64 patches and a class token)."""

    def __init__(self, patch: int = 4, dim: int = 192, depth: int = 4, heads: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (32 // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


SEQUENCE = 128


class BertLogits(nn.Module):
    """A HuggingFace BERT classifier as a module that gives its logits: the forward a
    fusion group records (a forward_fn would put the group through vmap)."""

    def __init__(self, hidden: int = 256, layers: int = 4, heads: int = 4, lora: int = 0) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=4 * hidden, max_position_embeddings=512, num_labels=2)  # fmt: skip
        if not lora:
            self.bert = BertForSequenceClassification(config)
            return
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):  # one "pretrained" base for every configuration
            torch.manual_seed(0)
            base = BertForSequenceClassification(config)
        adapters = LoraConfig(r=lora, lora_alpha=2 * lora, target_modules=["query", "value"], task_type="SEQ_CLS")
        self.bert = get_peft_model(base, adapters)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids).logits


def timm_model(name: str, **options: Any) -> Callable[[], nn.Module]:
    """A builder of timm's own model ``name`` for 10 classes (timm needs torchvision, so
    these run where a GPU torch has both)."""

    def build() -> nn.Module:
        import timm

        return timm.create_model(name, num_classes=10, **options)

    return build


def cnn() -> nn.Module:
    from mnist1d_models import ConvNet

    return ConvNet(32)


# name: (description, builder, input (rows -> (x, y)), typical batch b, steps per side per round at k=8:
# about 1 to 5 s of each side's training per round on one thread)
def _images(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 3, 32, 32, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


def _sequences(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(0, 30522, (rows, SEQUENCE), generator=generator),
            torch.randint(0, 2, (rows,), generator=generator))  # fmt: skip


def _mnist1d(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 40, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


MODELS: dict[str, tuple[str, Callable[[], nn.Module], Callable[..., tuple[torch.Tensor, torch.Tensor]], int, int]] = {
    "cnn": ("bench_fusion's 1-D CNN (MNIST-1D, 1x40)", cnn, _mnist1d, 64, 60),
    "resnet18": ("ResNet-18-shaped (BatchNorm)", lambda: ResNet((2, 2, 2, 2), tiered_stem=False), _images, 32, 2),
    "resnet10t": ("ResNet-10t-shaped (BatchNorm)", lambda: ResNet((1, 1, 1, 1), tiered_stem=True), _images, 32, 3),
    "vit": ("ViT, patch 4, depth 4, dim 192 (SDPA, LayerNorm, GELU)", ViT, _images, 32, 1),
    "bert": (f"HF BERT-small, hidden 256, 4 layers, seq {SEQUENCE}", BertLogits, _sequences, 16, 1),
    "bert-lora": (
        f"the same BERT with LoRA (r 8, query and value), its base frozen, seq {SEQUENCE}",
        lambda: BertLogits(lora=8),
        _sequences,
        16,
        1,
    ),
}
# timm's own models: name -> (description, timm's name, its options); bench_gpu.py's too
TIMM_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "timm-resnet10t": ("timm resnet10t", "resnet10t", {}),
    "timm-resnet18": ("timm resnet18", "resnet18", {}),
    "timm-vit": ("timm ViT, patch 4, depth 4, dim 192 (vit_tiny_patch16_224's blocks)", "vit_tiny_patch16_224",
                 {"img_size": 32, "patch_size": 4, "depth": 4}),
}  # fmt: skip
_TIMM_STEPS = {"timm-resnet10t": 3, "timm-resnet18": 2, "timm-vit": 1}
MODELS.update({key: (description, timm_model(name, **options), _images, 32, _TIMM_STEPS[key])
               for key, (description, name, options) in TIMM_MODELS.items()})  # fmt: skip


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=x) if x.dtype == torch.long else model(x)
    return out.logits if hasattr(out, "logits") else out


# --- the ceiling ----------------------------------------------------------------------------------


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)


def _now() -> float:
    """The time, once the GPU (if any is in use) has finished what it was given."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]
           ) -> float:  # fmt: skip
    """Train on each batch; returns the seconds spent in ``optimizer.step`` on the CPU (on a
    GPU, timing it would stall the queue of kernels: ``_optimizer_step_seconds`` then)."""
    in_step = 0.0
    on_cpu = batches[0][0].device.type == "cpu"
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(logits(model, x), y).backward()
        started = time.perf_counter() if on_cpu else 0.0
        optimizer.step()
        in_step += time.perf_counter() - started if on_cpu else 0.0
    return in_step


def _optimizer_step_seconds(optimizer: torch.optim.Optimizer, repeats: int = 10) -> float:
    """One ``optimizer.step`` on the gradients it holds, timed over ``repeats`` in a row."""
    started = _now()
    for _ in range(repeats):
        optimizer.step()
    return (_now() - started) / repeats


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _on(device: torch.device, batches: Batches) -> Batches:
    return [(x.to(device), y.to(device)) for x, y in batches]


def ceiling(name: str, k: int, b: int, steps: int, rounds: int, device: torch.device = CPU) -> dict[str, Any]:
    """Seconds of k models at batch b one after another against one model at batch k·b, each
    round's pair run in alternating order; the medians and the ratio's."""
    _, build, data, _, _ = MODELS[name]
    generator = torch.Generator().manual_seed(0)
    big_batches = _on(device, [data(k * b, generator) for _ in range(steps)])
    models = []
    for i in range(k):
        torch.manual_seed(i)
        model = build().to(device).train()
        models.append((model, _optimizer(model)))
    torch.manual_seed(k)
    big = build().to(device).train()
    big_opt = _optimizer(big)
    mine = [[(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]) for x, y in big_batches] for i in range(k)]
    for model, opt in models:  # one untimed step each: the first pays for allocations
        _steps(model, opt, mine[0][:1])
    _steps(big, big_opt, big_batches[:1])
    apart, together, opt_seconds, ratios = [], [], [], []

    def run_apart() -> None:
        started = _now()
        in_step = sum(_steps(model, opt, mine[i]) for i, (model, opt) in enumerate(models))
        apart.append(_now() - started)
        opt_seconds.append(in_step / (k * steps))

    def run_together() -> None:
        started = _now()
        _steps(big, big_opt, big_batches)
        together.append(_now() - started)

    for r in range(rounds):
        for run in (run_apart, run_together) if r % 2 == 0 else (run_together, run_apart):
            run()
        ratios.append(apart[-1] / together[-1])
    one_opt = statistics.median(opt_seconds) if device.type == "cpu" else _optimizer_step_seconds(models[0][1])
    tight = [a / (t + (k - 1) * steps * one_opt) for a, t in zip(apart, together, strict=True)]
    return {"model": name, "k": k, "b": b, "steps": steps, "rounds": rounds,
            "apart_s": statistics.median(apart), "together_s": statistics.median(together),
            "apart_rounds_s": apart, "together_rounds_s": together,
            "optimizer_step_s": one_opt, "ceiling": statistics.median(ratios),
            "ceiling_range": [min(ratios), max(ratios)],
            "ceiling_with_k_steps": statistics.median(tight),
            "params": sum(p.numel() for p in big.parameters())}  # fmt: skip


# --- the fused path (the library's fusion group) ----------------------------------------------------


def _model_fn(config: dict) -> nn.Module:
    return MODELS[config["model"]][1]()


def _optimizer_fn(config: dict, params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=config["lr"], weight_decay=1e-2)


def fused(name: str, k: int, b: int, steps: int, rounds: int, device: torch.device = CPU) -> dict[str, Any]:
    """One fusion group's unit of ``steps`` batches (``train_group``), fused against its members
    one by one through the same loop: a first unit of each untimed (it pays the imports of a
    first fused step), then ``rounds`` units of each, taking turns."""
    from bench_fusion import OneByOneSpec

    from cerebro_automl import TrainingSpec
    from cerebro_automl.data import TensorShard
    from cerebro_automl.fusion import Member, StackedModels, group_config
    from cerebro_automl.training import train_group

    _, build, data, _, _ = MODELS[name]
    common: dict[str, Any] = dict(model_fn=_model_fn, optimizer_fn=_optimizer_fn, batch_size="batch_size")
    specs = {"fused": TrainingSpec(**common), "one by one": OneByOneSpec(**common)}
    members = [Member(i, {"model": name, "lr": 1e-3 * (i + 1), "batch_size": b}, 100 + i) for i in range(k)]
    shard_x, shard_y = data(steps * b, torch.Generator().manual_seed(1))
    shard = TensorShard(shard_x, shard_y)
    times: dict[str, list[float]] = {n: [] for n in specs}
    states: dict[str, Any] = dict.fromkeys(specs)
    for r in range(-1, rounds):
        for spec_name in list(specs) if r % 2 == 0 else list(specs)[::-1]:
            started = _now()
            states[spec_name] = train_group(specs[spec_name], group_config(members), states[spec_name], shard,
                                            device=device, epoch=r + 1, partition=0, step=0,
                                            epoch_end=True, deadline=None, fresh_hyperparameters=False)  # fmt: skip
            assert not states[spec_name]["failed"], states[spec_name]["failed"]
            if r >= 0:
                times[spec_name].append(_now() - started)
    reason = states["fused"]["unfused"]
    if reason is not None:
        path = f"one by one: {reason}"
    elif StackedModels([build() for _ in range(2)]).layers_for(shard_x[:b]) is not None:
        path = "batched calls"
    else:
        path = "vmap"
    ratios = [a / f for a, f in zip(times["one by one"], times["fused"], strict=True)]
    return {
        "fused_s": statistics.median(times["fused"]),
        "one_by_one_s": statistics.median(times["one by one"]),
        "fused_speedup": statistics.median(ratios),
        "fused_range": [min(ratios), max(ratios)],
        "path": path,
    }


# --- the report -------------------------------------------------------------------------------------


def _share_frozen(models: list[nn.Module]) -> None:
    """Give every model the first one's frozen parameters, as a worker's members of one
    checkpoint share its base (a fused group does not stack them)."""
    for model in models[1:]:
        for name, param in list(model.named_parameters()):
            if not param.requires_grad:
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner), leaf, models[0].get_parameter(name))


def steps_alone(name: str, k: int, b: int, steps: int, rounds: int, device: torch.device = CPU) -> dict[str, Any]:
    """A fusion group's training steps without its unit (no state stacked in or written
    out): forward, backward and the fused AdamW step of k stacked members, against the
    same k models' own steps, one after another, on the same batches; rounds alternate."""
    from cerebro_automl.fusion import StackedModels
    from cerebro_automl.fusion.optim import FusedOptimizer
    from cerebro_automl.training.groups import cross_entropy_per_member

    _, build, data, _, _ = MODELS[name]
    batches = _on(device, [data(b, torch.Generator().manual_seed(s)) for s in range(steps)])

    def built() -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        models = []
        for i in range(k):
            torch.manual_seed(i)
            models.append(build().to(device).train())
        return models, [_optimizer(model) for model in models]

    # The unfused models each with its own frozen base, as the ceiling's (k workers'
    # processes); the members with one, as a worker's group of one checkpoint.
    models, optimizers = built()
    members, member_optimizers = built()
    _share_frozen(members)
    for model, opt in zip(members, member_optimizers, strict=True):  # the moments exist before stacking
        _steps(model, opt, batches[:1])
    stacked = StackedModels(members)
    trained = [{n: p for n, p in m.named_parameters() if p.requires_grad} for m in members]
    fused_opt = FusedOptimizer.from_members(stacked.trainable(), list(zip(trained, member_optimizers, strict=True)))

    def run_fused() -> None:
        for x, y in batches:
            fused_opt.zero_grad()
            out = stacked.batched_forward(x)
            out = stacked.call(logits, x) if out is None else out
            cross_entropy_per_member(out, y.expand(k, *y.shape)).sum().backward()
            fused_opt.step()

    def run_apart() -> None:
        for model, opt in zip(models, optimizers, strict=True):
            _steps(model, opt, batches)

    times: dict[str, list[float]] = {"fused": [], "apart": []}
    run_fused()  # the first steps pay for allocations, and the fused one records the forward
    run_apart()
    for r in range(rounds):
        for side, run in (("fused", run_fused), ("apart", run_apart))[:: 1 if r % 2 == 0 else -1]:
            started = _now()
            run()
            times[side].append(_now() - started)
    ratios = [a / f for a, f in zip(times["apart"], times["fused"], strict=True)]
    return {"steps_alone": steps, "step_fused_s": statistics.median(times["fused"]) / steps,
            "step_apart_s": statistics.median(times["apart"]) / steps,
            "step_speedup": statistics.median(ratios), "step_range": [min(ratios), max(ratios)]}  # fmt: skip


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _range(low_high: list[float]) -> str:
    return f"{low_high[0]:.2f}-{low_high[1]:.2f}"


def report(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    fused_cols = any("fused_speedup" in r for r in rows)
    head = (
        "| model | k | b | steps | one model at k·b, ms/step | k models at b, ms/step | ceiling "
        "| ceiling with k optimizer steps |"
    )
    rule = "|---|---|---|---|---|---|---|---|"
    if fused_cols:
        head += " fuse=k now vs one by one | fuse=k now vs k models at b | fuse=k path |"
        rule += "---|---|---|"
    lines = [
        "# What fusion can gain: the ceiling on the CPU",
        "",
        f"`{command}` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPU cores ({cpu_model()}), "
        f"torch {torch.__version__}, one torch thread. Training steps (forward, backward, AdamW step), "
        f"`steps` per round for each of the k models and for the one model, median of {args.rounds} round(s) "
        "(the ratios: the median of the rounds' ratios, lowest-highest). "
        "Ceiling = (k models at batch b, one after another) / (one model at batch k·b), the same samples.",
        "",
        "<!-- --8<-- [start:table] -->",
        head,
        rule,
    ]
    for r in rows:
        line = (f"| {MODELS[r['model']][0]} | {r['k']} | {r['b']} | {r['steps']} | "
                f"{1e3 * r['together_s'] / r['steps']:.1f} | "
                f"{1e3 * r['apart_s'] / r['steps']:.1f} | **{r['ceiling']:.2f}x** ({_range(r['ceiling_range'])}) | "
                f"{r['ceiling_with_k_steps']:.2f}x |")  # fmt: skip
        if fused_cols:
            line += (f" {r['fused_speedup']:.2f}x ({_range(r['fused_range'])}) | {r['apart_s'] / r['fused_s']:.2f}x | "
                     f"{r['path']} |" if "fused_speedup" in r else " not run | | |")  # fmt: skip
        lines.append(line)
    lines += [
        "<!-- --8<-- [end:table] -->",
        "",
        "ms/step: the seconds of the round's steps over the steps, for all k·b samples of a step. "
        "Ceiling with k optimizer steps: the one model's time plus (k-1) of its AdamW steps, as a fused "
        "unit steps k sets of weights. fuse=k now: one fusion group's unit (`train_group`, the same "
        "steps) against the same members trained one by one through the same loop, and against the k models "
        "at batch b of the ceiling's own loop (the median of the ceiling's numerator over the fused unit's: "
        "the figure to hold against the ceiling); its path is the one the group took (the batched calls, "
        "`vmap`, or one by one with the reason).",
    ]
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    low = [m for m, rs in by_model.items() if all(r["ceiling"] < 1.3 for r in rs)]
    if low:
        at = {m: ", ".join(f"k={r['k']} {r['ceiling']:.2f}x" for r in by_model[m]) for m in low}
        named = "; ".join(f"{MODELS[m][0]} ({at[m]})" for m in low)
        lines += ["", f"Ceiling under 1.3x at every k (fusion cannot pay there on this CPU): {named}."]
    above = [
        r
        for r in rows
        if "fused_s" in r  # against both unfused loops, beyond the noise
        and min(r["apart_s"] / r["fused_s"], r["fused_speedup"]) > 1.1 * r["ceiling"]
    ]
    if above:
        named = "; ".join(f"{MODELS[r['model']][0]} at k={r['k']}" for r in above)
        lines += ["", f"fuse=k above the ceiling (its kernels beat the unfused model's at batch k·b): {named}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS),
                        default=[m for m in MODELS if not m.startswith("timm-")])  # timm's need torchvision
    parser.add_argument("-k", type=int, nargs="+", default=[4, 8], help="models per group")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="training steps per side per round (default: per model)")
    parser.add_argument("--no-fused", action="store_true", help="skip timing the fuse=k path")
    parser.add_argument("--quick", action="store_true", help="a tiny size: k=2, batch 2, 1 step, 1 round")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.quick:
        args.k, args.rounds, args.steps = [2], 1, 1
    torch.set_num_threads(1)
    shown = [a for i, a in enumerate(sys.argv[1:]) if not a.startswith("--out") and sys.argv[i] != "--out"]
    command = " ".join(["python benchmarks/bench_fusion_ceiling.py", *shown])
    rows = []
    for name in args.models:
        b = 2 if args.quick else MODELS[name][3]
        for k in args.k:
            started = time.perf_counter()
            steps = args.steps or MODELS[name][4]
            row = ceiling(name, k, b, steps, args.rounds)
            if not args.no_fused:
                row.update(fused(name, k, b, steps, args.rounds))
            rows.append(row)
            print(f"{name} k={k} b={b}: ceiling {row['ceiling']:.2f}x ({_range(row['ceiling_range'])}), "
                  f"with k optimizer steps {row['ceiling_with_k_steps']:.2f}x"
                  + (f", fuse=k now {row['fused_speedup']:.2f}x via {row['path']}" if "fused_speedup" in row else "")
                  + f" [{time.perf_counter() - started:.0f} s]", flush=True)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = report(rows, args, command)
    print(table)
    (out / "fusion_ceiling.md").write_text(table + "\n")
    (out / "fusion_ceiling.json").write_text(json.dumps(
        {"rows": rows, "command": command, "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
         "date": datetime.now(timezone.utc).date().isoformat()}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
