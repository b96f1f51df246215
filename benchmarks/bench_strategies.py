"""MOP against every other way to run the same model selection, on the same 2 workers.

    python benchmarks/bench_strategies.py [--full] [--skip-memory] [--out benchmarks/results]

The Cerebro paper's comparison, reproduced on this machine. One workload: a
16-configuration grid (MLP or 1-D CNN x batch size 64/256 x learning rate x
weight decay, AdamW) trained for E epochs on MNIST-1D generated at a larger
size, with the validation accuracy measured after every epoch. Five strategies:

1. MOP: cerebro_automl on a LocalCluster of 2 single-threaded workers; each
   worker holds one of the 2 partitions.
2. Task parallelism: the same cluster shape; every worker holds a full copy of
   the data (``client.scatter(..., broadcast=True)``) and Dask hands it whole
   configurations, one task each (how Ray Tune, Celery or Optuna on Dask run trials).
3. DDP: ``torch.distributed`` DistributedDataParallel with gloo on 2 processes,
   one configuration at a time; each process holds half the data and takes half
   of every mini-batch (Horovod's algorithm).
4. Model averaging per epoch: 2 processes, each trains a replica one pass over
   its half per epoch, then the weights are averaged (all-reduce); TF's BSP.
5. Model averaging every tau = 50 mini-batches (SparkNet): the same, averaging
   after every 50 local steps and at each epoch's end.
6. An asynchronous parameter server: a third process holds the weights and the
   optimizer; each of the 2 workers pulls the weights, computes the gradient of
   a mini-batch of its half and pushes it, and the server applies every gradient
   as it arrives, with no barrier (Hogwild-style; the Cerebro paper's "async
   PS"). The only barrier is at each epoch's end, where the server evaluates.
7. Sequential: one single-threaded worker, one configuration after another:
   the convergence reference.

Whether a strategy reproduces itself: each runs a small workload (2
configurations x 2 epochs, 4000 samples) twice; "reruns equal" says whether the
two runs' validation curves are identical to the last bit.

Per strategy: makespan (clusters and process groups are started before the
clock), peak RSS per worker (VmHWM of each worker process), the bytes of
data (training and validation) each worker holds, the bytes moved between processes (the
loopback interface's byte counter, /proc/net/dev, over the timed part: data
shipped to workers, model states, gradients, results and Dask's own traffic),
utilization (the sequential run's compute seconds / (2 x makespan): how much
of the 2 workers' time did the work one worker needs), and every
configuration's validation accuracy per epoch. Then ratios against MOP and a
plot of each strategy's best learning curve.

The memory-bound variant: several GB of synthetic data (a random teacher
labels Gaussian features), generated on the workers themselves, trained by
MOP and by task parallelism; there the difference shows in the measured RSS
and not only by arithmetic.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import os
import resource
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import distributed  # noqa: F401  (before the log levels are set)
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy  # noqa: E402
from cerebro_automl.executors.dask import start_local_cluster  # noqa: E402
from cerebro_automl.results import plot_learning_curves  # noqa: E402
from mnist1d_models import load_mnist1d, model_fn, optimizer_fn  # noqa: E402

WORKERS = 2
SPEC = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy},
                    batch_size="batch_size", eval_batch_size=4096)


def grid() -> list[dict[str, Any]]:
    """The paper's 16-configuration grid: 2 architectures x 2 batch sizes x 2 lr x 2 wd."""
    return [{"arch": arch, "width": 128 if arch == "mlp" else 32, "batch_size": batch,
             "lr": lr, "weight_decay": wd}
            for arch, batch, lr, wd in itertools.product(("mlp", "cnn"), (64, 256), (1e-3, 4e-3),
                                                         (1e-4, 1e-2))]


# ------------------------------------------------------------------ measuring
def _cerebro_bytes(dask_worker) -> int:
    """Bytes of the partitions cerebro_automl placed on this worker (runs there)."""
    return sum(v.nbytes for k, v in dask_worker.data.items()
               if str(k).startswith("cerebro-place") and hasattr(v, "nbytes"))


def loopback_bytes() -> int:
    """Bytes received on the loopback interface so far (this network namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[0])
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds() -> float:
    """CPU seconds of this process so far, all threads (on the driver: the session and
    the in-process Dask scheduler; on a worker: the units and Dask's comms)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _one_thread() -> None:
    torch.set_num_threads(1)


def evaluate(model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """(correct, rows) on ``X, y``, in batches."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for lo in range(0, len(X), 4096):
            correct += int((model(X[lo:lo + 4096]).argmax(1) == y[lo:lo + 4096]).sum())
    model.train()
    return correct, len(X)


def train_epoch(model, opt, X, y, batch_size: int, generator: torch.Generator) -> None:
    for idx in torch.randperm(len(X), generator=generator).split(batch_size):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()


# ------------------------------------------------- task parallelism, sequential
def train_whole_config(index: int, config: dict, epochs: int, data: tuple) -> dict:
    """One Dask task: a whole configuration on the worker's full copy of the data."""
    torch.set_num_threads(1)
    X, y, Xv, yv = (torch.from_numpy(a) for a in data)
    started = time.perf_counter()
    torch.manual_seed(index)
    model = model_fn(config)
    opt = optimizer_fn(config, model.parameters())
    gen = torch.Generator().manual_seed(index)
    curve = []
    for _ in range(epochs):
        train_epoch(model, opt, X, y, config["batch_size"], gen)
        correct, rows = evaluate(model, Xv, yv)
        curve.append(correct / rows)
    return {"index": index, "curve": curve, "seconds": time.perf_counter() - started}


def run_whole_configs(name: str, workers: int, arrays: tuple, configs: list, epochs: int) -> dict:
    """Task parallelism on ``workers`` workers (1: the sequential reference)."""
    with start_local_cluster(workers) as cluster, Client(cluster) as client:
        client.run(_one_thread)
        before, cpu, workers_cpu = loopback_bytes(), cpu_seconds(), client.run(cpu_seconds)
        started = time.perf_counter()
        copy = client.scatter(arrays, broadcast=True, hash=False)  # a full copy on every worker
        futures = [client.submit(train_whole_config, i, c, epochs, copy, pure=False)
                   for i, c in enumerate(configs)]
        results = client.gather(futures)
        makespan = time.perf_counter() - started
        moved, cpu = loopback_bytes() - before, cpu_seconds() - cpu
        workers_cpu = _spent(workers_cpu, client.run(cpu_seconds))
        rss = list(client.run(peak_rss_bytes).values())
        del copy, futures
    return row(name, makespan, rss, [sum(a.nbytes for a in arrays)] * workers, moved,
               {r["index"]: r["curve"] for r in results},
               compute=sum(r["seconds"] for r in results), driver_cpu=cpu, workers_cpu=workers_cpu)


# ----------------------------------------------------------------------- MOP
def run_mop(arrays: tuple, configs: list, epochs: int) -> dict:
    X, y, Xv, yv = arrays
    data = PartitionedDataset.from_arrays(X, y, num_partitions=WORKERS, valid=(Xv, yv))
    with start_local_cluster(WORKERS) as cluster, Client(cluster) as client:
        client.run(_one_thread)
        before, cpu, workers_cpu = loopback_bytes(), cpu_seconds(), client.run(cpu_seconds)
        started = time.perf_counter()
        with Session(SPEC, data, client=client, seed=0) as session:
            ids = {session.add(c, epochs=epochs): i for i, c in enumerate(configs)}
            history = session.run()
            makespan = time.perf_counter() - started
            moved, cpu = loopback_bytes() - before, cpu_seconds() - cpu
            workers_cpu = _spent(workers_cpu, client.run(cpu_seconds))
            held = list(client.run(_cerebro_bytes).values())
        rss = list(client.run(peak_rss_bytes).values())
    curves = {ids[m]: list(h.sort_values("epoch")["val_accuracy"]) for m, h in history.groupby("model_id")}
    compute = float(history["train_seconds"].sum() + history["val_seconds"].sum())
    result = row("MOP (cerebro_automl)", makespan, rss, held, moved, curves, compute=compute,
                 driver_cpu=cpu, workers_cpu=workers_cpu)
    result["engine_utilization"] = compute / (WORKERS * makespan)
    return result


# ------------------------------------------------------- DDP, model averaging
def _rendezvous(folder: str) -> str:
    """The ranks meet through a file in their shared folder: a port picked free and
    then released could be taken by another process before rank 0 binds it."""
    return "file://" + os.path.join(folder, "rendezvous")


TAU = 50  # SparkNet's local steps between two averagings


def _exit_now() -> None:
    """End a rank's process once its results are on disk, without the interpreter's
    teardown: a rank has died there with SIGABRT ("terminate called without an active
    exception", a C++ thread still joinable as its object was destroyed), which
    failed a run whose results were already written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _average(model: torch.nn.Module, world: int) -> None:
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                dist.all_reduce(tensor)
                tensor /= world


def distributed_rank(rank: int, mode: str, configs: list, epochs: int, folder: str) -> None:
    """One of the 2 processes of DDP (``mode="ddp"``), model averaging per epoch
    (``"average"``) or every TAU mini-batches (``"average_tau"``)."""
    torch.set_num_threads(1)
    world = WORKERS
    dist.init_process_group("gloo", init_method=_rendezvous(folder), rank=rank, world_size=world)

    def shard(name: str) -> torch.Tensor:  # only this rank's half is read into memory
        whole = np.load(os.path.join(folder, name + ".npy"), mmap_mode="r")
        lo, hi = rank * len(whole) // world, (rank + 1) * len(whole) // world
        return torch.from_numpy(np.array(whole[lo:hi]))

    X, y, Xv, yv = (shard(n) for n in ("X", "y", "Xv", "yv"))
    dist.barrier()
    before, cpu = loopback_bytes(), cpu_seconds()
    started = time.perf_counter()
    curves = {}
    for index, config in enumerate(configs):
        torch.manual_seed(index)  # the same initial weights on both ranks
        model = model_fn(config)
        trained = torch.nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
        opt = optimizer_fn(config, trained.parameters())
        # DDP: each rank takes half of every mini-batch (the global batch stays batch_size).
        batch = config["batch_size"] // world if mode == "ddp" else config["batch_size"]
        gen = torch.Generator().manual_seed(1000 * index + rank)
        curves[index] = []
        # Both ranks must average equally often: they take the same number of steps.
        steps = torch.tensor([-(-len(X) // batch)])
        dist.all_reduce(steps, op=dist.ReduceOp.MIN)
        for _ in range(epochs):
            if mode == "average_tau":
                for step, idx in enumerate(torch.randperm(len(X), generator=gen).split(batch)[:int(steps)]):
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
                    opt.step()
                    if (step + 1) % TAU == 0:
                        _average(model, world)
            else:
                train_epoch(trained, opt, X, y, batch, gen)
            if mode in ("average", "average_tau"):
                _average(model, world)
            counts = torch.tensor(evaluate(model, Xv, yv), dtype=torch.float64)
            dist.all_reduce(counts)
            curves[index].append(float(counts[0] / counts[1]))
    dist.barrier()
    seconds = time.perf_counter() - started
    moved, cpu = loopback_bytes() - before, cpu_seconds() - cpu
    data_bytes = sum(t.numpy().nbytes for t in (X, y, Xv, yv))
    Path(folder, f"rank{rank}.json").write_text(json.dumps(
        {"seconds": seconds, "moved": moved, "cpu": cpu, "rss": peak_rss_bytes(), "data_bytes": data_bytes,
         "curves": curves}))
    dist.destroy_process_group()
    _exit_now()


def run_distributed(name: str, mode: str, arrays: tuple, configs: list, epochs: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        for n, a in zip(("X", "y", "Xv", "yv"), arrays):
            np.save(os.path.join(folder, n + ".npy"), a)
        cpu = cpu_seconds()
        mp.spawn(distributed_rank, args=(mode, configs, epochs, folder), nprocs=WORKERS)
        cpu = cpu_seconds() - cpu  # the parent only waits (start-up included)
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(WORKERS)]
    curves = {int(k): v for k, v in ranks[0]["curves"].items()}
    return row(name, max(r["seconds"] for r in ranks), [r["rss"] for r in ranks],
               [r["data_bytes"] for r in ranks], ranks[0]["moved"], curves, driver_cpu=cpu,
               workers_cpu=sum(r["cpu"] for r in ranks))


# ------------------------------------------------------ async parameter server
def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def parameter_server_rank(rank: int, configs: list, epochs: int, folder: str) -> None:
    """Rank 0 holds the weights and the optimizer and applies each pushed gradient as it
    arrives; ranks 1 and 2 each train on their half: pull, compute a gradient, push."""
    torch.set_num_threads(1)
    world, workers = WORKERS + 1, WORKERS
    dist.init_process_group("gloo", init_method=_rendezvous(folder), rank=rank, world_size=world)
    load = lambda name: np.load(os.path.join(folder, name + ".npy"), mmap_mode="r")  # noqa: E731
    if rank == 0:
        Xv, yv = torch.from_numpy(np.array(load("Xv"))), torch.from_numpy(np.array(load("yv")))
        data_bytes = Xv.numpy().nbytes + yv.numpy().nbytes
    else:
        lo, hi = ((rank - 1) * len(load("X")) // workers, rank * len(load("X")) // workers)
        X, y = torch.from_numpy(np.array(load("X")[lo:hi])), torch.from_numpy(np.array(load("y")[lo:hi]))
        data_bytes = X.numpy().nbytes + y.numpy().nbytes
    dist.barrier()
    before, cpu = loopback_bytes(), cpu_seconds()
    started = time.perf_counter()
    curves: dict[int, list[float]] = {}
    header = torch.zeros(1, dtype=torch.int64)  # 0: a gradient follows; 1: this worker's epoch is done
    for index, config in enumerate(configs):
        torch.manual_seed(index)
        model = model_fn(config)
        params = list(model.parameters())
        flat = _flat(p.detach() for p in params)
        if rank == 0:
            opt = optimizer_fn(config, params)
            curves[index] = []
            for worker in range(1, world):
                dist.send(flat, worker)
            for _ in range(epochs):
                done = 0
                while done < workers:
                    sender = dist.recv(header)  # from whichever worker is first
                    if int(header[0]) == 1:
                        done += 1
                        continue
                    grad = torch.empty_like(flat)
                    dist.recv(grad, sender)
                    for p, g in zip(params, torch.split(grad, [p.numel() for p in params])):
                        p.grad = g.view_as(p).clone()
                    opt.step()
                    dist.send(_flat(p.detach() for p in params), sender)
                correct, rows = evaluate(model, Xv, yv)
                curves[index].append(correct / rows)
                weights = _flat(p.detach() for p in params)
                for worker in range(1, world):  # the epoch barrier: everyone starts from the same weights
                    dist.send(weights, worker)
        else:
            gen = torch.Generator().manual_seed(1000 * index + rank)
            dist.recv(flat, 0)
            for _ in range(epochs):
                with torch.no_grad():
                    _unflatten_into(flat, params)
                for idx in torch.randperm(len(X), generator=gen).split(config["batch_size"]):
                    model.zero_grad()
                    torch.nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
                    header[0] = 0
                    dist.send(header, 0)
                    dist.send(_flat(p.grad for p in params), 0)
                    dist.recv(flat, 0)  # the server's weights, newer than the ones this gradient saw
                    with torch.no_grad():
                        _unflatten_into(flat, params)
                header[0] = 1
                dist.send(header, 0)
                dist.recv(flat, 0)
    dist.barrier()
    seconds = time.perf_counter() - started
    moved, cpu = loopback_bytes() - before, cpu_seconds() - cpu
    Path(folder, f"rank{rank}.json").write_text(json.dumps(
        {"seconds": seconds, "moved": moved, "cpu": cpu, "rss": peak_rss_bytes(), "data_bytes": data_bytes,
         "curves": curves}))
    dist.destroy_process_group()
    _exit_now()


def run_parameter_server(arrays: tuple, configs: list, epochs: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        for n, a in zip(("X", "y", "Xv", "yv"), arrays):
            np.save(os.path.join(folder, n + ".npy"), a)
        cpu = cpu_seconds()
        mp.spawn(parameter_server_rank, args=(configs, epochs, folder), nprocs=WORKERS + 1)
        cpu = cpu_seconds() - cpu
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(WORKERS + 1)]
    curves = {int(k): v for k, v in ranks[0]["curves"].items()}
    return row("async parameter server (3 processes)", max(r["seconds"] for r in ranks),
               [r["rss"] for r in ranks[1:]], [r["data_bytes"] for r in ranks[1:]], ranks[0]["moved"], curves,
               driver_cpu=cpu + ranks[0]["cpu"], workers_cpu=sum(r["cpu"] for r in ranks[1:]))


# ------------------------------------------------------------------ reporting
def _spent(before: dict, after: dict) -> float:
    """CPU seconds the workers spent between two ``client.run(cpu_seconds)``."""
    return sum(after[w] - before[w] for w in after if w in before)


def row(strategy: str, makespan: float, rss: list, data_bytes: list, moved: int, curves: dict,
        compute: float | None = None, driver_cpu: float | None = None,
        workers_cpu: float | None = None) -> dict:
    finals = {i: c[-1] for i, c in curves.items()}
    best = max(finals, key=lambda i: (finals[i], -i))
    return {"strategy": strategy, "makespan_s": makespan, "peak_rss_mb": [b / 2**20 for b in rss],
            "data_mb_per_worker": [b / 2**20 for b in data_bytes], "moved_mb": moved / 2**20,
            "curves": {str(i): c for i, c in sorted(curves.items())}, "best_config": best,
            "best_accuracy": finals[best], "mean_accuracy": float(np.mean(list(finals.values()))),
            "compute_s": compute, "driver_cpu_s": driver_cpu, "workers_cpu_s": workers_cpu}


def learning_curve_table(rows: list[dict], configs: list) -> pd.DataFrame:
    """Each strategy's best configuration as one 'model' of a history table."""
    records = []
    for k, r in enumerate(rows):
        for epoch, acc in enumerate(r["curves"][str(r["best_config"])], start=1):
            records.append({"model_id": k, "epoch": epoch, "val_accuracy": acc,
                            "strategy": r["strategy"], "config": configs[r["best_config"]]})
    return pd.DataFrame(records)


def config_label(config: dict) -> str:
    return f"{config['arch']} b{config['batch_size']} lr{config['lr']:g} wd{config['weight_decay']:g}"


def strategies_report(rows: list[dict], configs: list, epochs: int, samples: int, full: bool,
                      out: Path) -> str:
    mop, sequential = rows[0], rows[-1]

    def find(prefix: str) -> dict:
        return next(r for r in rows if r["strategy"].startswith(prefix))
    work = sequential["compute_s"]
    for r in rows:
        r["utilization"] = work / (WORKERS * r["makespan_s"])
        r["ratio_makespan"] = r["makespan_s"] / mop["makespan_s"]
        r["ratio_data"] = max(r["data_mb_per_worker"]) / max(mop["data_mb_per_worker"])
        r["ratio_rss"] = max(r["peak_rss_mb"]) / max(mop["peak_rss_mb"])
        r["accuracy_gap_points"] = 100 * (mop["best_accuracy"] - r["best_accuracy"])
        r["mean_gap_points"] = 100 * (mop["mean_accuracy"] - r["mean_accuracy"])
    task, ddp, average = find("task parallelism"), find("DDP"), find("model averaging (per epoch)")
    lines = [
        "# MOP against the other ways to run the same model selection",
        "",
        "<!-- --8<-- [start:table] -->",
        f"`python benchmarks/bench_strategies.py{' --full' if full else ''}` — "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, 2 workers "
        f"(sequential: 1), torch {torch.__version__}, dask {distributed.__version__}. "
        f"{len(configs)} configurations x {epochs} epochs, MNIST-1D {samples} samples "
        f"({int(samples * 0.8)} train / {int(samples * 0.2)} validation).",
        "",
        "| strategy | makespan (s) | vs MOP | peak RSS per worker (MB) | data per worker (MB) "
        "| moved between processes (MB) | utilization | CPU s: workers / driver | best val. acc. (gap to MOP, points) "
        "| mean val. acc. of the 16 (gap) | reruns equal | best config |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['makespan_s']:.1f} | {r['ratio_makespan']:.2f}x | "
            + ", ".join(f"{m:.0f}" for m in r["peak_rss_mb"]) + " | "
            + ", ".join(f"{m:.2f}" for m in r["data_mb_per_worker"])
            + f" | {r['moved_mb']:.1f} | {r['utilization']:.2f} | {r['workers_cpu_s']:.1f} / {r['driver_cpu_s']:.1f} | {r['best_accuracy']:.3f} "
              f"({r['accuracy_gap_points']:+.1f}) | {r['mean_accuracy']:.3f} ({r['mean_gap_points']:+.1f}) | "
              f"{'yes' if r.get('reruns_equal') else 'no' if 'reruns_equal' in r else '-'} | "
              f"{config_label(configs[r['best_config']])} |")
    lines.append("<!-- --8<-- [end:table] -->")
    checks = [
        ("MOP makespan within 1.10x of task parallelism", mop["makespan_s"] / task["makespan_s"], "x",
         mop["makespan_s"] <= 1.10 * task["makespan_s"]),
        ("MOP data per worker at most 0.55x of task parallelism", 1 / task["ratio_data"], "x",
         1 / task["ratio_data"] <= 0.55),
        ("MOP best accuracy within 1 point of sequential", -sequential["accuracy_gap_points"], " points (sequential - MOP)",
         abs(sequential["accuracy_gap_points"]) <= 1.0),
        ("MOP faster than DDP", ddp["makespan_s"] / mop["makespan_s"], "x (DDP / MOP)",
         mop["makespan_s"] < ddp["makespan_s"]),
        ("model averaging visibly behind MOP: best configuration", average["accuracy_gap_points"], " points",
         average["accuracy_gap_points"] >= 1.0),
        ("model averaging visibly behind MOP: mean of the configurations", average["mean_gap_points"],
         " points", average["mean_gap_points"] >= 1.0),
    ]
    lines += ["", "<!-- --8<-- [start:targets] -->", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {text} | {value:.2f}{unit} | {'yes' if ok else '**no**'} |" for text, value, unit, ok in checks]
    lines += ["<!-- --8<-- [end:targets] -->", "", "<!-- --8<-- [start:utilization] -->", "Utilization: the sequential run's compute seconds / (2 workers x makespan). "
              f"MOP's own measure (unit compute / (2 x makespan)) was {mop['engine_utilization']:.2f}. "
              f"Compute seconds measured inside the units or tasks: MOP {mop['compute_s']:.1f}, task "
              f"parallelism {task['compute_s']:.1f}, sequential {work:.1f} (wall-clock, so they include "
              "time a unit waited for a core). "
              "CPU seconds: all threads of the worker processes (ranks) and of the driver (the "
              "session and the in-process Dask scheduler; for DDP and averaging, the waiting "
              "parent) over the run; on 2 cores the driver's come out of the workers' time.",
              "<!-- --8<-- [end:utilization] -->", "", "Validation accuracy after the last epoch, per configuration:", "",
              "| config | " + " | ".join(r["strategy"] for r in rows) + " |",
              "|---|" + "---|" * len(rows)]
    for i, c in enumerate(configs):
        lines.append(f"| {config_label(c)} | " + " | ".join(f"{r['curves'][str(i)][-1]:.3f}" for r in rows) + " |")
    plot_learning_curves(learning_curve_table(rows, configs), "val_accuracy", mode="max", top=None,
                         label=lambda first: f"{first['strategy']}: {config_label(first['config'])}",
                         title=f"Best configuration per strategy, MNIST-1D {samples} samples",
                         path=out / "strategies_curves.png")
    return "\n".join(lines)


# ---------------------------------------------------------- memory-bound variant
FEATURES = 128


def synthetic_partition(index: int, parts: int, rows: int, out: np.ndarray | None = None) -> tuple:
    """Partition ``index`` of ``parts``: Gaussian features, labels from a fixed random
    teacher, and 5000 validation rows; written into ``out`` (rows x FEATURES) if given."""
    n = rows // parts
    rng = np.random.default_rng([7, index])
    X = np.empty((n, FEATURES), np.float32) if out is None else out
    rng.standard_normal(dtype=np.float32, out=X)
    teacher = np.random.default_rng(0).standard_normal(FEATURES).astype(np.float32)
    Xv = np.random.default_rng([7, index, 1]).standard_normal((5000, FEATURES), dtype=np.float32)
    return X, (X @ teacher > 0).astype(np.int64), Xv, (Xv @ teacher > 0).astype(np.int64)


def synthetic_full(rows: int) -> tuple:
    """The whole synthetic dataset (both partitions), built in place on a worker."""
    X = np.empty((rows // WORKERS * WORKERS, FEATURES), np.float32)
    n = rows // WORKERS
    parts = [synthetic_partition(i, WORKERS, rows, out=X[i * n:(i + 1) * n]) for i in range(WORKERS)]
    return (X, np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]),
            np.concatenate([p[3] for p in parts]))


def _wide_model(config):
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))


WIDE_SPEC = TrainingSpec(model_fn=_wide_model, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy},
                         batch_size=1024, eval_batch_size=4096)
WIDE_CONFIGS = [{"lr": lr} for lr in (3e-4, 1e-3, 3e-3, 1e-2)]


def train_wide(index: int, config: dict, data: tuple) -> dict:
    torch.set_num_threads(1)
    X, y, Xv, yv = (torch.from_numpy(a) for a in data)
    torch.manual_seed(index)
    model = _wide_model(config)
    opt = optimizer_fn(config, model.parameters())
    train_epoch(model, opt, X, y, 1024, torch.Generator().manual_seed(index))
    correct, n = evaluate(model, Xv, yv)
    return {"index": index, "accuracy": correct / n}


def memory_bound(rows: int) -> dict:
    """MOP and task parallelism on ``rows`` x 128 float32 rows made on the workers, 1 epoch."""
    out = {}
    # memory_limit=0: no spilling or pausing, so that RSS shows what each strategy holds.
    with start_local_cluster(WORKERS, memory_limit=0) as cluster, Client(cluster) as client:
        client.run(_one_thread)
        data = PartitionedDataset.from_loader(functools.partial(synthetic_partition, parts=WORKERS, rows=rows),
                                              WORKERS, has_validation=True)
        started = time.perf_counter()
        with Session(WIDE_SPEC, data, client=client, seed=0) as session:
            for c in WIDE_CONFIGS:
                session.add(c, epochs=1)
            history = session.run()
            held = list(client.run(_cerebro_bytes).values())
            makespan = time.perf_counter() - started
        out["mop"] = {"makespan_s": makespan, "rss_mb": [b / 2**20 for b in client.run(peak_rss_bytes).values()],
                      "data_mb": [b / 2**20 for b in held],
                      "best_accuracy": float(history["val_accuracy"].max())}
    with start_local_cluster(WORKERS, memory_limit=0) as cluster, Client(cluster) as client:
        client.run(_one_thread)
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        started = time.perf_counter()
        copies = [client.submit(synthetic_full, rows, workers=[w], pure=False) for w in workers]
        futures = [client.submit(train_wide, i, c, copies[i % WORKERS], workers=[workers[i % WORKERS]],
                                 pure=False) for i, c in enumerate(WIDE_CONFIGS)]
        results = client.gather(futures)
        makespan = time.perf_counter() - started
        held = client.run(lambda dask_worker: sum(a.nbytes for v in dask_worker.data.values()
                                                   if isinstance(v, tuple) for a in v))
        out["task"] = {"makespan_s": makespan,
                       "rss_mb": [b / 2**20 for b in client.run(peak_rss_bytes).values()],
                       "data_mb": [b / 2**20 for b in held.values()],
                       "best_accuracy": max(r["accuracy"] for r in results)}
        del copies, futures
    out["rows"], out["gb"] = rows, rows * (FEATURES + 2) * 4 / 1e9
    return out


def memory_report(m: dict, full: bool) -> str:
    mop, task = m["mop"], m["task"]
    lines = [
        "## Memory-bound variant",
        "",
        "<!-- --8<-- [start:memory] -->",
        f"`python benchmarks/bench_strategies.py{' --full' if full else ''}` — {m['rows']:,} rows x "
        f"{FEATURES} float32 features ({m['gb']:.1f} GB of training data), made on the workers; "
        f"{len(WIDE_CONFIGS)} MLPs, 1 epoch, 2 workers.",
        "",
        "| strategy | makespan (s) | peak RSS per worker (MB) | data per worker (MB) | best val. acc. |",
        "|---|---|---|---|---|",
    ]
    for name, r in (("MOP (cerebro_automl)", mop), ("task parallelism", task)):
        lines.append(f"| {name} | {r['makespan_s']:.1f} | " + ", ".join(f"{x:.0f}" for x in r["rss_mb"])
                     + " | " + ", ".join(f"{x:.0f}" for x in r["data_mb"]) + f" | {r['best_accuracy']:.3f} |")
    m["ratio_rss"] = max(mop["rss_mb"]) / max(task["rss_mb"])
    m["ratio_makespan"] = mop["makespan_s"] / task["makespan_s"]
    lines += ["", f"MOP / task parallelism: peak RSS per worker {m['ratio_rss']:.2f}x, "
                  f"makespan {m['ratio_makespan']:.2f}x.", "<!-- --8<-- [end:memory] -->"]
    return "\n".join(lines)


def strategy_runs() -> list[tuple[str, Any]]:
    """``(name, run(arrays, configs, epochs) -> row)`` for every strategy; MOP first, sequential last."""
    return [
        ("MOP", run_mop),
        ("task parallelism", lambda a, c, e: run_whole_configs("task parallelism", WORKERS, a, c, e)),
        ("DDP", lambda a, c, e: run_distributed("DDP (gloo, 2 processes)", "ddp", a, c, e)),
        ("model averaging", lambda a, c, e: run_distributed("model averaging (per epoch)", "average", a, c, e)),
        ("SparkNet averaging", lambda a, c, e: run_distributed(f"model averaging (every {TAU} mini-batches)",
                                                               "average_tau", a, c, e)),
        ("parameter server", run_parameter_server),
        ("sequential", lambda a, c, e: run_whole_configs("sequential (1 worker)", 1, a, c, e)),
    ]


def reruns_equal(run: Any, arrays: tuple) -> bool:
    """Whether two runs of a small workload (2 configurations x 2 epochs) give identical curves."""
    first, second = (run(arrays, grid()[:2], 2) for _ in range(2))
    return first["curves"] == second["curves"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="MNIST-1D 200,000 samples x 10 epochs (default 100,000 x 4); "
                             "6 GB memory-bound variant (default 2 GB)")
    parser.add_argument("--skip-memory", action="store_true", help="skip the memory-bound variant")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    samples, epochs, memory_rows = (200_000, 10, 11_500_000) if args.full else (100_000, 4, 3_800_000)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arrays = load_mnist1d(samples)
    configs = grid()

    rows = []
    small = load_mnist1d(5000)
    for name, run in strategy_runs():
        print(f"running {name} ...", flush=True)
        rows.append(run(arrays, configs, epochs))
        rows[-1]["reruns_equal"] = reruns_equal(run, small)
        print(f"  {rows[-1]['makespan_s']:.1f} s, best {rows[-1]['best_accuracy']:.3f}, "
              f"reruns equal: {rows[-1]['reruns_equal']}", flush=True)
    text = strategies_report(rows, configs, epochs, samples, args.full, out)
    result: dict[str, Any] = {"samples": samples, "epochs": epochs, "configs": configs, "rows": rows}
    if not args.skip_memory:
        print("running the memory-bound variant ...", flush=True)
        result["memory_bound"] = memory_bound(memory_rows)
        text += "\n\n" + memory_report(result["memory_bound"], args.full)
    print(text)
    (out / "strategies.md").write_text(text + "\n")
    (out / "strategies.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
