"""Fine-tuning a pretrained model: a peft LoRA search over a local HuggingFace
checkpoint, with the frozen base kept on the workers against the whole model hopping.

    python benchmarks/bench_finetune.py [--rows 256] [--epochs 2] [--big-base] [--out benchmarks/results]

A BERT-style classifier (seeded random weights, 11M parameters) is saved with
``save_pretrained`` into a local folder; ``model_fn`` loads it with
``from_pretrained`` and wraps it with peft LoRA, as a user writes it. 8
configurations (LoRA rank x learning rate) x ``--epochs`` epochs on 2 single-threaded
workers, three ways:

* the whole model hops (``TrainingSpec(frozen_base=False)``: every unit calls
  ``model_fn`` and moves the whole state);
* the frozen base (the default): only the adapters and the classifier hop;
* task parallelism: each trial in its own process (2 at a time), the base loaded
  once per trial, the whole training set in every process.

Reported: bytes that hop per unit (one model's state), makespan, peak worker memory,
best val accuracy, and whether every model-epoch's val_loss equals the whole-model
run's bit for bit. ``--big-base`` adds a 400M-parameter frozen base (1.6 GB in
float32) under a small head, one batch per unit: the time a unit costs beyond its
compute, with the whole model hopping and with the frozen base.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import resource
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import distributed
import numpy as np
import torch
from distributed import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402
from cerebro_automl.executors.dask import start_local_cluster  # noqa: E402

WORKERS, LENGTH, VOCAB = 2, 32, 30522
CONFIGS = [{"r": r, "lr": lr} for r in (4, 8) for lr in (3e-4, 1e-3, 3e-3, 1e-2)]


def save_base(folder: str) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=LENGTH, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(folder)


def tokens(rows: int, seed: int):
    """Token ids labelled by whether token 7 appears."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, VOCAB, size=(rows, LENGTH))
    label = rng.integers(0, 2, size=rows)
    ids[np.arange(rows)[label == 1], rng.integers(0, LENGTH, size=int(label.sum()))] = 7
    return {"input_ids": ids.astype(np.int64), "attention_mask": np.ones_like(ids)}, label.astype(np.int64)


def lora_model_fn(folder: str):
    def model_fn(config):
        import transformers
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForSequenceClassification

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        base = AutoModelForSequenceClassification.from_pretrained(folder)
        return get_peft_model(base, LoraConfig(r=config["r"], lora_alpha=2 * config["r"],
                                               target_modules=["query", "value"], task_type="SEQ_CLS"))

    return model_fn


def adamw(config, params):
    return torch.optim.AdamW(params, lr=config["lr"])


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _state_bytes(state: dict) -> int:
    total = 0

    def walk(v):
        nonlocal total
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk({k: state[k] for k in ("model", "optimizer") if k in state})
    return total


def _median_run(results: list[dict]) -> dict:
    """The run of median makespan, with the range of every run's and the largest peak memory."""
    ordered = sorted(results, key=lambda r: r["makespan_s"])
    median = dict(ordered[len(ordered) // 2])
    median["makespan_range"] = (ordered[0]["makespan_s"], ordered[-1]["makespan_s"])
    median["peak_worker_rss_mib"] = max(r["peak_worker_rss_mib"] for r in results)
    return median


def mop(spec: TrainingSpec, data: PartitionedDataset, configs: list[dict], epochs: int) -> dict:
    with start_local_cluster(WORKERS) as cluster, Client(cluster) as client:
        with Session(spec, data, client=client, seed=0, progress=False) as s:
            started = time.perf_counter()
            ids = [s.add(c, epochs=epochs) for c in configs]
            history = s.run()
            makespan = time.perf_counter() - started
            state = s.model(ids[-1]).state()
        peak = max(client.run(_peak_rss_mib).values())
    return {"makespan_s": makespan, "hop_bytes": _state_bytes(state), "peak_worker_rss_mib": peak,
            "best_val_accuracy": float(history["val_accuracy"].max()),
            "val_loss": [float(v) for v in history.sort_values(["model_id", "epoch"])["val_loss"]]}


def _trial(args) -> tuple[float, float]:
    """One trial alone, as task parallelism runs it: (best val accuracy, peak RSS MiB)."""
    folder, config, epochs, rows = args
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = lora_model_fn(folder)(config)
    optimizer = adamw(config, model.parameters())
    X, y = tokens(rows, 0)
    Xv, yv = tokens(rows // 4, 1)
    best = 0.0
    for epoch in range(epochs):
        model.train()
        order = np.random.default_rng(epoch).permutation(len(y))
        for start in range(0, len(y), 32):
            rows_ = order[start:start + 32]
            out = model(**{k: torch.from_numpy(v[rows_]) for k, v in X.items()}).logits
            loss = torch.nn.functional.cross_entropy(out, torch.from_numpy(y[rows_]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            out = model(**{k: torch.from_numpy(v) for k, v in Xv.items()}).logits
        best = max(best, float((out.argmax(1) == torch.from_numpy(yv)).float().mean()))
    return best, _peak_rss_mib()


def task_parallel(folder: str, epochs: int, rows: int) -> dict:
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(WORKERS) as pool:
        results = pool.map(_trial, [(folder, c, epochs, rows) for c in CONFIGS], chunksize=1)
    makespan = time.perf_counter() - started
    model = lora_model_fn(folder)(CONFIGS[-1])
    hop = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    return {"makespan_s": makespan, "hop_bytes": hop, "peak_worker_rss_mib": max(r[1] for r in results),
            "best_val_accuracy": max(r[0] for r in results), "val_loss": None}


class BigBase(torch.nn.Module):
    """24 frozen 4096x4096 layers (403M parameters, seeded) under a small trainable head."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        layers = []
        for _ in range(24):
            layer = torch.nn.Linear(4096, 4096)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(4096, 4096, generator=g) / 64)
                layer.bias.zero_()
            layers += [layer, torch.nn.Tanh()]
        self.base = torch.nn.Sequential(*layers).requires_grad_(False)
        self.head = torch.nn.Linear(4096, 2)

    def forward(self, x):
        return self.head(self.base(x))


def big_base(frozen_base: bool, units: int) -> dict:
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(16, 4096)).astype(np.float32), rng.integers(0, 2, 16)
    spec = TrainingSpec(model_fn=lambda c: BigBase(), optimizer_fn=adamw, batch_size=8, frozen_base=frozen_base)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=WORKERS)
    with start_local_cluster(WORKERS) as cluster, Client(cluster) as client:
        with Session(spec, data, client=client, seed=0, progress=False) as s:
            s.add({"lr": 1e-3}, epochs=1)
            s.run()  # the first epoch builds the base on each worker
            started = time.perf_counter()
            s.extend(0, epochs=units // WORKERS)
            s.run()
            per_unit = (time.perf_counter() - started) / units
            # what hops: a 1.6 GB state would take minutes to bring to the driver, so the
            # whole model's is counted from its layout (the head's optimizer moments included)
            state = s.model(0).state() if frozen_base else None
        peak = max(client.run(_peak_rss_mib).values())
    model = BigBase()
    if state is None:
        head_moments = 2 * sum(p.numel() * p.element_size() for p in model.head.parameters())
        state = {"model": model.state_dict(), "optimizer": {"moments": torch.empty(head_moments, dtype=torch.uint8)}}
    return {"unit_s": per_unit, "hop_bytes": _state_bytes(state), "peak_worker_rss_mib": peak}


def big_base_compute(rounds: int = 7) -> float:
    """The median seconds of one unit's compute alone (forward and backward of one batch of
    8 rows, the head's optimizer step), in this process."""
    model = BigBase()
    optimizer = adamw({"lr": 1e-3}, model.parameters())
    x, y = torch.randn(8, 4096), torch.randint(0, 2, (8,))
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return sorted(times)[rounds // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="training rows (validation: a quarter as many)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each way, in turn; medians reported")
    parser.add_argument("--big-base", action="store_true", help="also the 400M-parameter base (needs ~12 GB)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="bert-base-")
    save_base(folder)
    X, y = tokens(args.rows, 0)
    Xv, yv = tokens(args.rows // 4, 1)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=WORKERS, valid=(Xv, yv))
    common = dict(model_fn=lora_model_fn(folder), optimizer_fn=adamw, metrics={"accuracy": accuracy}, batch_size=32)
    ways = {
        "the whole model hops (frozen_base=False)": lambda: mop(TrainingSpec(**common, frozen_base=False), data,
                                                                CONFIGS, args.epochs),
        "the frozen base (default)": lambda: mop(TrainingSpec(**common), data, CONFIGS, args.epochs),
        "task parallelism (a process per trial)": lambda: task_parallel(folder, args.epochs, args.rows),
    }
    rounds: dict[str, list[dict]] = {name: [] for name in ways}
    for i in range(args.rounds):  # in turn, the order rotating, so that drift hits every way alike
        names = list(ways)[i % len(ways):] + list(ways)[:i % len(ways)]
        for name in names:
            rounds[name].append(ways[name]())
    runs = {name: _median_run(results) for name, results in rounds.items()}
    whole, kept = runs["the whole model hops (frozen_base=False)"], runs["the frozen base (default)"]
    same = whole["val_loss"] == kept["val_loss"]
    big = None
    if args.big_base:
        compute = big_base_compute()
        big = {"whole": big_base(False, 4), "frozen": big_base(True, 4)}
        for r in big.values():
            r["compute_s"], r["overhead_s"] = compute, r["unit_s"] - compute
    device = f"{os.cpu_count()} CPU cores"
    lines = [
        "# Fine-tuning: the frozen base against the whole model hopping",
        "",
        f"`python benchmarks/bench_finetune.py{' --big-base' if big else ''}` — "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {device}, torch {torch.__version__}, "
        f"dask {distributed.__version__}. A BERT-style classifier (11M parameters, seeded, saved with "
        f"`save_pretrained`) loaded by `from_pretrained` in `model_fn` and wrapped by peft LoRA on query and "
        f"value; {len(CONFIGS)} configurations (rank 4, 8 x 4 learning rates) x {args.epochs} epochs, "
        f"{args.rows} training rows of {LENGTH} tokens in {WORKERS} partitions, {WORKERS} single-threaded workers.",
        "",
        "<!-- --8<-- [start:search] -->",
        f"| | one unit's hop | makespan, median of {args.rounds} (range) | peak worker memory | best val accuracy "
        "| val_loss as the whole model's |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        equal = "—" if r["val_loss"] is None else ("bit for bit" if r["val_loss"] == whole["val_loss"] else "no")
        lines.append(f"| {name} | {r['hop_bytes'] / 2**20:.2f} MiB | {r['makespan_s']:.1f} s "
                     f"({r['makespan_range'][0]:.1f}-{r['makespan_range'][1]:.1f}) | "
                     f"{r['peak_worker_rss_mib']:.0f} MiB | {r['best_val_accuracy']:.4f} | {equal} |")
    lines += [
        "",
        f"Frozen base against the whole model hopping: **{whole['makespan_s'] / kept['makespan_s']:.2f}x** faster, "
        f"{whole['hop_bytes'] / kept['hop_bytes']:.0f}x fewer bytes per hop; against task parallelism: "
        f"{runs['task parallelism (a process per trial)']['makespan_s'] / kept['makespan_s']:.2f}x. "
        "Task parallelism's hop column is the whole model, which each process loads for itself.",
        "<!-- --8<-- [end:search] -->",
    ]
    if big:
        lines += [
            "",
            "## A 400M-parameter frozen base (1.6 GB), a small head, one batch of 8 rows per unit",
            "",
            "<!-- --8<-- [start:big] -->",
            "| | one unit | its compute | overhead per unit | one unit's hop | peak worker memory |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in (("the whole model hops", big["whole"]), ("the frozen base", big["frozen"])):
            overhead = f"{r['overhead_s']:.2f} s" if r["overhead_s"] >= 0.05 else "under 0.05 s (the noise)"
            lines.append(f"| {name} | {r['unit_s']:.2f} s | {r['compute_s']:.2f} s | {overhead} | "
                         f"{r['hop_bytes'] / 2**20:.3f} MiB | {r['peak_worker_rss_mib']:.0f} MiB |")
        ratio = big["whole"]["unit_s"] / big["frozen"]["unit_s"]
        lines += [
            "",
            f"A unit with the whole model hopping takes **{ratio:.0f}x** as long as with the frozen base, whose "
            "unit is its compute and a Dask round trip: the overhead alone shrinks by more than that. "
            "Compute: one batch's forward, backward and step, median of 7 in one process.",
            "<!-- --8<-- [end:big] -->",
        ]
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "finetune.md").write_text(table + "\n")
    (out / "finetune.json").write_text(json.dumps({"runs": runs, "same_val_loss": same, "big_base": big,
                                                   "rows": args.rows, "epochs": args.epochs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
