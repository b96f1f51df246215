"""Fusion for the models people tune: for each model, k unfused models at batch b, one
fusion group of k members (``fuse=k``), and the ceiling (one unfused model at batch
k·b), the same training steps on the same samples, on the CPU or a GPU.

    python benchmarks/bench_fusion_models.py [--models resnet10t resnet18 vit bert bert-lora] [-k 8] [-b [MODEL=]B ...]
                                             [--rounds 3] [--steps N] [--device cpu|cuda] [--quick]
                                             [--out benchmarks/results]

The models and the two measurements are ``bench_fusion_ceiling.py``'s (see its
docstring): ``ceiling`` times k models at batch b one after another on one torch
thread against one model at batch k·b, and ``fused`` one group's unit
(``train_group``) against the same members trained one by one through the same loop.
Here each model's rows stand side by side, all per step of k·b samples, against the
k unfused models of the ceiling's own loop. ``steps_alone`` times the group's steps
without its unit (forward, backward and the fused AdamW step of the stacked members)
against the k models' steps in rounds of their own, taking turns: what a unit of
many steps approaches, where the rest of the unit (mostly stacking the members'
states in and writing them out, once a unit) weighs little. Results:
``fusion_models.{md,json}``, or ``fusion_models_gpu.{md,json}`` with ``--device cuda``,
where timm's own models (``timm-resnet10t``, ``timm-resnet18``, ``timm-vit``) can run
too. On a GPU the k unfused models still run one after another in one process: k
co-located workers overlap their kernels, which ``bench_gpu.py --parts fusion``
measures with a session.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fusion_ceiling import MODELS, _range, ceiling, cpu_model, fused, steps_alone  # noqa: E402


def rows_of(result: dict[str, Any]) -> list[tuple[str, float, str, str]]:
    """One measurement's rows: (run, ms per step of k·b samples, speed against the k unfused
    models at batch b, the path)."""
    steps, apart = result["steps"], result["apart_s"]
    rest = 1e3 * (result["fused_s"] - steps * result["step_fused_s"])
    # The two are timed apart, so a rest smaller than their noise can come out negative.
    rest_text = f"{rest:.0f} ms" if rest >= 0 else f"within the noise ({rest:.0f} ms)"
    return [
        ("k unfused models at batch b, one after another", 1e3 * apart / steps, "1.00x", ""),
        ("the same k, one by one through a group's loop", 1e3 * result["one_by_one_s"] / steps,
         f"{apart / result['one_by_one_s']:.2f}x", "one by one"),
        (f"fuse=k (one group); vs its one-by-one loop {result['fused_speedup']:.2f}x "
         f"({_range(result['fused_range'])})", 1e3 * result["fused_s"] / steps,
         f"**{apart / result['fused_s']:.2f}x**", result["path"]),
        ("ceiling: one unfused model at batch k·b", 1e3 * result["together_s"] / steps,
         f"{apart / result['together_s']:.2f}x ({_range(result['ceiling_range'])})", ""),
        (f"fuse=k, its steps alone (no unit: nothing stacked in or written out); the rest of the unit "
         f"{rest_text}", 1e3 * result["step_fused_s"],
         f"{result['step_speedup']:.2f}x ({_range(result['step_range'])})", result["path"]),
    ]  # fmt: skip


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, {os.cpu_count()} CPU cores"
    return f"{os.cpu_count()} CPU cores ({cpu_model()})"


def report(results: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    device = torch.device(args.device)
    where = f"GPU: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "CPU"
    lines = [
        f"# Fusion for the models people tune, against their ceiling ({where})",
        "",
        f"`{command}` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine(device)}, "
        f"torch {torch.__version__}, one torch thread. Training steps (forward, backward, AdamW step), "
        f"`steps` per round on each side, median of {args.rounds} round(s). {args.note}".rstrip(),
        "",
        "<!-- --8<-- [start:table] -->",
        "| model | k | b | steps | run | ms/step | vs k unfused models | fuse=k path |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for run, ms, speed, path in rows_of(r):
            lines.append(f"| {MODELS[r['model']][0]} | {r['k']} | {r['b']} | {r['steps']} | {run} | {ms:.1f} | "
                         f"{speed} | {path} |")  # fmt: skip
    lines += [
        "<!-- --8<-- [end:table] -->",
        "",
        "ms/step: a round's seconds over its steps, each step k·b samples (k members or models at batch b, "
        "or one model at batch k·b). vs k unfused models: their median time over this row's (the ceiling's "
        "own figure, the median of the rounds' ratios, with the lowest and highest). The steps alone are "
        "timed against the k models' steps in rounds of their own, taking turns (the median of the rounds' "
        "ratios, lowest-highest); the rest of the unit: the fused unit's time less its steps alone, timed apart "
        "(the members' weights and optimizer states stacked in and written out, the shard's batches, the "
        "epoch's end). fuse=k path: the batched "
        "calls, `vmap`, or one by one with the reason.",
    ]
    return "\n".join(lines)


def batch_sizes(given: list[str]) -> dict[str, str]:
    """``-b``'s values: model -> its batch size, "" -> every other model's."""
    sizes = dict(item.split("=", 1) if "=" in item else ("", item) for item in given)
    unknown = sorted(set(sizes) - {"", *MODELS})
    if unknown:
        raise ValueError(f"-b names {', '.join(unknown)}, but the models are {', '.join(MODELS)}")
    return sizes


def batch_size(model: str, given: list[str]) -> int:
    """The batch size of ``model``: its own ``MODEL=B`` from ``-b``, else a plain ``B``, else its default."""
    sizes = batch_sizes(given)
    return int(sizes.get(model, sizes.get("", MODELS[model][3])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", choices=list(MODELS), default=["resnet10t", "resnet18", "vit", "bert", "bert-lora"]
    )
    parser.add_argument("-k", type=int, nargs="+", default=[8], help="models per group")
    parser.add_argument("-b", nargs="+", default=[], metavar="[MODEL=]B",
                        help="each model's batch size, or one model's (default: per model)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="training steps per side per round (default: per model)")
    parser.add_argument("--note", default="", help="a sentence for the results (the machine's load)")
    parser.add_argument("--quick", action="store_true", help="a tiny size: k=2, batch 2, 1 step, 1 round")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.quick:
        args.k, args.rounds, args.steps = [2], 1, 1
    try:
        batch_sizes(args.b)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(1)
    shown = [a for i, a in enumerate(sys.argv[1:]) if not a.startswith("--out") and sys.argv[i] != "--out"]
    command = shlex.join(["python", "benchmarks/bench_fusion_models.py", *shown])
    device = torch.device(args.device)
    stem = "fusion_models" if device.type == "cpu" else "fusion_models_gpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    failed: list[str] = []

    def save() -> None:  # after every model, so that a run cut short keeps what it measured
        table = report(results, args, command)
        if failed:
            table += "\n\nNot measured (the error each raised): " + "; ".join(failed) + "."
        (out / f"{stem}.md").write_text(table + "\n")
        record = {"rows": results, "failed": failed, "command": command, "note": args.note, "cpu": cpu_model(),
                  "cores": os.cpu_count(), "device": machine(device), "torch": torch.__version__,
                  "date": datetime.now(timezone.utc).date().isoformat()}  # fmt: skip
        (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")

    for name in args.models:
        b = 2 if args.quick else batch_size(name, args.b)
        steps = args.steps or MODELS[name][4]
        for k in args.k:
            started = time.perf_counter()
            try:
                result = ceiling(name, k, b, steps, args.rounds, device)
                result.update(fused(name, k, b, steps, args.rounds, device))
                result.update(steps_alone(name, k, b, steps, args.rounds, device))
            except Exception as error:  # one model's failure leaves the others' figures
                traceback.print_exc()
                failed.append(f"{name} k={k}: {type(error).__name__}: {error}")
                gc.collect()  # its tensors (a GPU's memory) go before the next model's
                if torch.cuda.is_initialized():
                    torch.cuda.empty_cache()
                save()
                continue
            results.append(result)
            print(f"{name} k={k}: fused {result['apart_s'] / result['fused_s']:.2f}x of k unfused models "
                  f"({result['step_speedup']:.2f}x its steps alone), ceiling {result['ceiling']:.2f}x, "
                  f"via {result['path']} [{time.perf_counter() - started:.0f} s]",
                  flush=True)  # fmt: skip
            save()
    print((out / f"{stem}.md").read_text())
    if failed:
        sys.exit(1)

if __name__ == "__main__":
    main()
