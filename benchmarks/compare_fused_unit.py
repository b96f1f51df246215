"""One fusion group's unit in this process, no Dask: k members trained fused, against
the same group trained one by one (the same data order), for bench_fusion's MLP or
1-D CNN on 8,000 random rows (``--rows``), one torch thread.

    python benchmarks/compare_fused_unit.py [--arch mlp|cnn] [-k 8] [--repeat 5] [--rows 8000] [--eval] [--layers]

Prints the median seconds of each and their ratio: the compute side of fusion,
without the scheduling around it (``bench_fusion.py`` measures the whole search).
Both models train fused through the batched calls (``cerebro_automl.fusion.batched``);
each is also timed through ``vmap`` (a ``forward_fn`` that calls the model as the
default does sends it there), the path of a model whose forward has no batched form.
``--eval`` also times the group's evaluation of ``--rows`` rows: one batched pass
(a GPU's) against each member's own pass (the CPU's). ``--layers`` also times each
weighted layer's forward and backward alone, for k
members one by one against their batched call and against one ``vmap`` call over
their stacked weights (where a convolution becomes a grouped convolution): what
fusion can gain per kernel.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.func import functional_call, stack_module_state, vmap

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fusion import COMMON, OneByOneSpec  # noqa: E402
from mnist1d_models import model_fn  # noqa: E402

from cerebro_automl import TrainingSpec  # noqa: E402
from cerebro_automl.data import TensorShard  # noqa: E402
from cerebro_automl.fusion import Member, group_config  # noqa: E402
from cerebro_automl.fusion.batched import _convolution, _linear  # noqa: E402
from cerebro_automl.fusion.layouts import Value  # noqa: E402
from cerebro_automl.training import train_group  # noqa: E402
from cerebro_automl.training.groups import _fused_evaluation, evaluate_group  # noqa: E402


def unit_seconds(
    specs: dict[str, TrainingSpec], members: list[Member], shard: TensorShard, repeat: int
) -> dict[str, tuple[float, str | None]]:
    """Each spec's median seconds of a group's second unit (the first pays the imports of
    a first step) and its ``unfused`` reason; the specs take turns, round by round, so a
    drift in the machine's speed reaches them all alike."""
    times: dict[str, list[float]] = {name: [] for name in specs}
    reasons: dict[str, str | None] = {}
    for _ in range(repeat):
        for name, spec in specs.items():
            state = None
            for epoch in range(2):
                started = time.perf_counter()
                state = train_group(spec, group_config(members), state, shard, device=torch.device("cpu"),
                                    epoch=epoch, partition=0, step=0, epoch_end=True, deadline=None,
                                    fresh_hyperparameters=False)
            times[name].append(time.perf_counter() - started)
            reasons[name] = state["unfused"]
    return {name: (statistics.median(times[name]), reasons[name]) for name in specs}


def evaluation_seconds(spec: TrainingSpec, members: list[Member], shard: TensorShard, repeat: int
                       ) -> tuple[float, float]:  # fmt: skip
    """The median seconds of a trained group's evaluation on ``shard``: one batched pass,
    and each member's own (``evaluate_group`` on the CPU), taking turns."""
    state = train_group(spec, group_config(members), None, shard, device=torch.device("cpu"), epoch=0, partition=0,
                        step=0, epoch_end=True, deadline=None, fresh_hyperparameters=False)  # fmt: skip
    batched, apart = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        _fused_evaluation(spec, members, state["members"], shard)
        batched.append(time.perf_counter() - started)
        started = time.perf_counter()
        evaluate_group(spec, group_config(members), state, shard)
        apart.append(time.perf_counter() - started)
    return statistics.median(batched), statistics.median(apart)


def forward_through_vmap(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """The default forward, as a ``forward_fn``: a fused group then runs through ``vmap``."""
    return model(x), y


def _median_seconds(fn, repeat: int, calls: int = 50) -> float:
    fn()  # the first call pays for allocations
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - started) / calls)
    return statistics.median(times)


def layer_seconds(arch: str, width: int, k: int, repeat: int) -> list[tuple[str, float, float, float]]:
    """(layer, one by one, batched, vmap) seconds of one forward and backward of each
    Conv1d and Linear layer for k members, on the inputs batch 64 gives it. The first
    layer's input is the batch, shared by the members; the others' are the members' own."""
    model = model_fn({"arch": arch, "width": width})
    shapes: dict[str, torch.Size] = {}

    def record(name: str, inputs: tuple) -> None:
        shapes[name] = inputs[0].shape

    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.Linear)):
            module.register_forward_pre_hook(lambda _m, inputs, name=name: record(name, inputs))
    model(torch.randn(64, 40))
    rows = []
    for position, (name, shape) in enumerate(shapes.items()):
        layers = [copy.deepcopy(model.get_submodule(name)) for _ in range(k)]
        for layer in layers:
            layer._forward_pre_hooks.clear()
        shared = position == 0
        inputs = [torch.randn(shape, requires_grad=not shared) for _ in range(k)]

        def apart(layers=layers, inputs=inputs) -> None:
            for layer, x in zip(layers, inputs, strict=True):
                layer(x).sum().backward()

        params, _ = stack_module_state(layers)
        base = copy.deepcopy(layers[0]).to("meta")
        one = vmap(lambda p, x, base=base: functional_call(base, p, (x,)), in_dims=(0, None if shared else 0))
        batch = inputs[0] if shared else torch.stack(inputs).detach().requires_grad_()

        def through_vmap(one=one, params=params, batch=batch) -> None:
            one(params, batch).sum().backward()

        def batched(layer=layers[0], params=params, batch=batch, shared=shared) -> None:
            value = Value(batch, "shared" if shared else "front")
            if isinstance(layer, torch.nn.Linear):
                out = _linear(value, params["weight"], params["bias"], k)
            else:
                out = _convolution(value, params["weight"], params["bias"], layer.stride, layer.padding,
                                   layer.dilation, layer.groups, k)  # fmt: skip
            out.tensor.sum().backward()

        rows.append((f"{name} {type(layers[0]).__name__} {tuple(shape)}", _median_seconds(apart, repeat),
                     _median_seconds(batched, repeat), _median_seconds(through_vmap, repeat)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("-k", type=int, default=8, help="members in the group")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8000, help="rows of the partition a unit passes over")
    parser.add_argument("--eval", action="store_true", help="also time the group's evaluation, batched and one by one")
    parser.add_argument("--layers", action="store_true", help="also time each layer's forward and backward alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    width = 128 if args.arch == "mlp" else 32
    members = [Member(i, {"arch": args.arch, "width": width, "batch_size": 64, "lr": 1e-3 * (i + 1),
                          "weight_decay": 1e-3}, 100 + i) for i in range(args.k)]
    generator = torch.Generator().manual_seed(0)
    shard = TensorShard(torch.randn(args.rows, 40, generator=generator),
                        torch.randint(0, 10, (args.rows,), generator=generator))
    specs = {"fused": TrainingSpec(**COMMON), "apart": OneByOneSpec(**COMMON),
             "through vmap": TrainingSpec(**COMMON, forward_fn=forward_through_vmap)}
    timed = unit_seconds(specs, members, shard, args.repeat)
    (fused, reason), (apart, _) = timed["fused"], timed["apart"]
    assert reason is None, reason
    seconds = timed["through vmap"][0]
    through_vmap = f", fused through vmap {seconds:.3f} s ({seconds / fused:.2f}x the batched calls' time)"
    print(f"{args.arch}, k={args.k}, {args.rows} rows, batch 64: fused {fused:.3f} s, one by one {apart:.3f} s, "
          f"one by one / fused {apart / fused:.2f}x{through_vmap}")
    if args.eval:
        batched, apart = evaluation_seconds(specs["fused"], members, shard, args.repeat)
        print(f"  evaluation of {args.rows} rows (eval batch size {COMMON['eval_batch_size']}): one batched pass "
              f"{batched:.3f} s, each member's own {apart:.3f} s (batched / own {batched / apart:.2f}x)")
    if args.layers:
        for layer, alone, together, vmapped in layer_seconds(args.arch, width, args.k, args.repeat):
            print(f"  {layer}: one by one {alone * 1e3:.3f} ms, batched {together * 1e3:.3f} ms "
                  f"({alone / together:.2f}x), through vmap {vmapped * 1e3:.3f} ms ({alone / vmapped:.2f}x)")


if __name__ == "__main__":
    main()
