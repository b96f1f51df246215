"""A search over image files: MOP on Dask against task parallelism with DataLoader,
on the same cores (issue 45's benchmark).

    python benchmarks/bench_files_search.py [--images 20000] [--configs 8] [--epochs 3] [--workers 2]
                                            [--data /tmp/cerebro-bench-files-search] [--out benchmarks/results]

The data: ``--images`` JPEGs of 64x64 (quality 90), drawn with Pillow from a seeded
generator, in 10 class subfolders and listed class by class (as a folder is), plus a
validation folder of a tenth as many; each class is a hue of oriented stripes on a
noisy background of another colour (neighbouring hues overlap, so a small CNN learns
them, not perfectly). Written once under ``--data`` and reused.

A small CNN (two strided convolutions of ``width`` and ``2 * width`` channels, global
average pooling, a linear layer), Adam, batch size 64, ``--configs`` configurations
(lr x width, at most 8) x ``--epochs`` epochs, validated after every epoch. The process
is pinned to ``--workers`` cores (the first the process may use), and everything below
inherits them. Rows:

(a) MOP over the files: ``from_image_folder(cache=None, decode_threads=1)``, a
    LocalCluster of ``--workers`` single-threaded workers, one partition each;
(b) MOP over the same images decoded into arrays in memory (``from_arrays``; the
    decoding, on the driver, is not timed);
(c) MOP with ``cache="disk"`` (the encoded originals, in each worker's scratch folder)
    and a ``random_transform`` that crops a random part of the original (50-100% of
    its area, aspect 3/4-4/3) and resizes it to 64x64;
(d) task parallelism as users run it: each trial in its own process (this script run
    with ``--trial``, ``--workers`` at a time), torch on one thread, a
    map-style Dataset that opens each file with PIL, ``DataLoader(num_workers=1,
    shuffle=True)`` for training and validation.

Columns: training samples per second of makespan (configs x epochs x images / makespan),
the makespan (MOP: from the Session's start, which ships or loads the partitions, to its
close, on a cluster started and warmed beforehand, a fresh one for each row; task
parallelism: from the first trial's launch to the last one's end, each trial's process
start and imports included), the peak
RSS per worker (a Dask worker process's VmHWM, reset after the warm-up and read with
``client.run``; a trial's process's VmHWM, reset when the trial starts, and beside it its
DataLoader workers' RSS, sampled every 0.1 s), and the best final-epoch validation
accuracy of the configurations.
And (a)'s samples/s over (d)'s, against issue 45's goal of at least 0.9x. Written to
files_search.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

# Kept light at the top: each trial of row (d) runs this file in a process of its own.
ROOT = Path(__file__).resolve().parents[1]
SIZE, CLASSES, BATCH, EVAL_BATCH = 64, 10, 64, 256
GOAL = 0.9
DATA_VERSION = 2  # bump when draw() changes: the cached folders are keyed by it
CONFIGS = [{"lr": lr, "width": w} for lr in (1e-3, 1e-2) for w in (8, 16, 24, 32)]


# --- the data ------------------------------------------------------------------------------


def draw(rng: np.random.Generator, label: int) -> np.ndarray:
    """A 64x64 RGB image of class ``label``: stripes of the class's hue (jittered, so that
    neighbouring classes overlap) at a random angle, period and phase, on a noisy background."""
    import colorsys

    hue = (label / CLASSES + rng.normal(0, 0.025)) % 1.0
    stripe = np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.7, 1.0), rng.uniform(0.8, 1.0))) * 255
    background = rng.uniform(0, 110, 3)
    angle, period, phase = rng.uniform(0, math.pi), rng.uniform(6, 14), rng.uniform(0, 2 * math.pi)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    wave = 0.5 + 0.5 * np.sin(2 * math.pi * (xx * math.cos(angle) + yy * math.sin(angle)) / period + phase)
    image = wave[..., None] * stripe + (1 - wave[..., None]) * background
    image += rng.normal(0, 24, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def write_folder(folder: Path, images: int, seed: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    for n in range(images):
        label = n * CLASSES // images  # sorted by class, as a folder lists its files
        (folder / f"c{label}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(draw(rng, label)).save(folder / f"c{label}" / f"{n:06d}.jpg", "JPEG", quality=90)


def dataset_folders(top: Path, images: int) -> tuple[Path, Path]:
    """``top/v<version>-n<images>/{train,valid}``, written once (a ``done`` file marks it complete)."""
    import shutil

    folder = top / f"v{DATA_VERSION}-n{images}"
    if not (folder / "done").exists():
        shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        write_folder(folder / "train", images, seed=0)
        write_folder(folder / "valid", max(CLASSES, images // 10), seed=1)
        (folder / "done").write_text("")
        print(f"wrote {folder} in {time.perf_counter() - start:.0f} s", flush=True)
    return folder / "train", folder / "valid"


def listing(root: Path) -> list[tuple[str, int]]:
    """(path, label) of every image, as torchvision's ImageFolder lists them."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    return [(str(path), c) for c, name in enumerate(classes) for path in sorted((root / name).glob("*.jpg"))]


def decode(path: str) -> torch.Tensor:
    from PIL import Image

    with Image.open(path) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB")).transpose(2, 0, 1).copy())


# --- the model, shared by every row --------------------------------------------------------


def cnn(config: dict) -> torch.nn.Module:
    w = config["width"]
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, w, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(2 * w, CLASSES),
    )  # fmt: skip


def adam(config: dict, params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=config["lr"])


def normalise(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.float() / 255 - 0.5, y


def random_resized_crop(image, generator: torch.Generator) -> torch.Tensor:
    """A training item of row (c): a random part of the original (50-100% of its area,
    aspect 3/4-4/3), resized to SIZE x SIZE; every draw from ``generator``."""
    w, h = image.size
    area = w * h * (0.5 + 0.5 * torch.rand(1, generator=generator).item())
    ratio = math.exp(math.log(3 / 4) + math.log(16 / 9) * torch.rand(1, generator=generator).item())
    cw, ch = min(w, round(math.sqrt(area * ratio))), min(h, round(math.sqrt(area / ratio)))
    left = int(torch.randint(0, w - cw + 1, (1,), generator=generator))
    top = int(torch.randint(0, h - ch + 1, (1,), generator=generator))
    pixels = np.asarray(image.resize((SIZE, SIZE), box=(left, top, left + cw, top + ch)))
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


# --- (a)-(c): MOP on Dask -----------------------------------------------------------------


def reset_peak_rss() -> None:
    """Start this process's peak RSS (VmHWM) again from its RSS now. A process started by
    fork and exec has a ``ru_maxrss`` that starts at its parent's RSS (Linux keeps the high-water mark across
    exec), so neither it nor an unreset VmHWM is this process's own peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mib() -> float:
    """This process's peak RSS since :func:`reset_peak_rss` (VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def warm_worker() -> int:
    import PIL.Image  # noqa: F401

    import cerebro_automl  # noqa: F401

    torch.set_num_threads(1)
    torch.zeros(1)
    reset_peak_rss()
    return os.getpid()


def mop(make_data, configs: list[dict], epochs: int, workers: int) -> dict:
    """One search by MOP on a fresh LocalCluster of ``workers`` single-threaded workers."""
    import logging

    from distributed import Client

    from cerebro_automl import Session, TrainingSpec, accuracy
    from cerebro_automl.executors.dask import start_local_cluster

    logging.getLogger("distributed").setLevel(logging.ERROR)
    spec = TrainingSpec(model_fn=cnn, optimizer_fn=adam, metrics={"accuracy": accuracy}, batch_size=BATCH,
                        eval_batch_size=EVAL_BATCH, eval_transform=normalise,
                        train_transform=lambda x, y, g: normalise(x, y))  # fmt: skip
    with start_local_cluster(workers) as cluster, Client(cluster) as client:
        client.wait_for_workers(workers)
        client.run(warm_worker)
        data = make_data()  # lists the files on the driver (untimed); the Session loads the partitions
        start = time.perf_counter()
        with Session(spec, data, client=client, seed=0, progress=False) as s:
            for config in configs:
                s.add(config, epochs=epochs)
            history = s.run()
            errors = [s.model(i).error for i in range(len(configs))]
        makespan = time.perf_counter() - start
        rss = client.run(peak_rss_mib)
    if any(errors):
        raise RuntimeError(f"a model failed: {errors}")
    last = history.sort_values("epoch").groupby("model_id").tail(1).sort_values("model_id")  # final epochs
    assert len(last) == len(configs) and (last.epoch == last.epoch.max()).all(), history
    return {
        "makespan_s": makespan,
        "peak_rss_mib_per_worker": sorted(rss.values()),
        "final_val_accuracy": [float(v) for v in last.val_accuracy],
        "train_seconds_sum": float(history.train_seconds.sum()) if "train_seconds" in history else None,
    }


# --- (d): task parallelism, a process per trial with a DataLoader -------------------------


class ImageFiles(torch.utils.data.Dataset):
    """A plain map-style Dataset over an image folder: PIL opens and decodes each file."""

    def __init__(self, root: str) -> None:
        self.items = listing(Path(root))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[i]
        return decode(path), label


def trial(config: dict, train_root: str, valid_root: str, epochs: int, seed: int) -> dict:
    """One trial, as a user writes it: runs in a process of its own."""
    started = time.time()
    reset_peak_rss()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    from torch.utils.data import DataLoader

    train, valid = ImageFiles(train_root), ImageFiles(valid_root)
    model, generator = cnn(config), torch.Generator().manual_seed(seed)
    optimizer = adam(config, model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    accuracies = []
    for _ in range(epochs):
        model.train()
        for images, labels in DataLoader(train, batch_size=BATCH, shuffle=True, num_workers=1, generator=generator):
            x, y = normalise(images, labels)
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        model.eval()
        right = 0
        with torch.no_grad():
            for images, labels in DataLoader(valid, batch_size=EVAL_BATCH, num_workers=1):
                x, y = normalise(images, labels)
                right += int((model(x).argmax(1) == y).sum())
        accuracies.append(right / len(valid))
    return {
        "val_accuracy": accuracies,
        "started": started,
        "seconds": time.time() - started,
        "peak_rss_mib": peak_rss_mib(),
        "pid": os.getpid(),
    }


class LoaderSampler:
    """Samples, every ``interval`` s in a thread of the driver, the RSS of the processes that
    this process's children (the trials) started (their DataLoader workers): the peak of
    each trial's loader processes together, by the trial's pid, in MiB."""

    def __init__(self, interval: float = 0.1) -> None:
        import threading

        import psutil

        self.me, self.interval = psutil.Process(), interval
        self.peak: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for child in self.me.children():
                try:
                    rss = sum(p.memory_info().rss for p in child.children(recursive=True)) / 2**20
                except Exception:  # a process ended meanwhile: the next sample counts the rest
                    continue
                self.peak[child.pid] = max(self.peak.get(child.pid, 0.0), rss)

    def __enter__(self) -> LoaderSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def task_parallel(train_root: Path, valid_root: Path, configs: list[dict], epochs: int, workers: int) -> dict:
    """Each trial a ``python bench_files_search.py --trial ...`` process of its own (so its
    DataLoader starts its workers the platform's usual way: fork, on Linux with Python
    3.11), ``workers`` at a time; each prints its result as JSON."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def run(i: int, config: dict) -> dict:
        job = {"config": config, "train_root": str(train_root), "valid_root": str(valid_root), "epochs": epochs,
               "seed": i}  # fmt: skip
        command = [sys.executable, str(Path(__file__).resolve()), "--trial", json.dumps(job)]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    start = time.perf_counter()
    wall_start = time.time()
    with LoaderSampler() as loaders, ThreadPoolExecutor(workers) as pool:
        trials = list(pool.map(run, range(len(configs)), configs))
    makespan = time.perf_counter() - start
    return {
        "makespan_s": makespan,
        "peak_rss_mib_per_worker": sorted(t["peak_rss_mib"] for t in trials),
        "loader_peak_rss_mib": sorted(loaders.peak.get(t["pid"], 0.0) for t in trials),
        "final_val_accuracy": [t["val_accuracy"][-1] for t in trials],
        "trial_start_delay_s": [t["started"] - wall_start for t in trials],
        "trial_seconds": [t["seconds"] for t in trials],
    }


# --- the report ----------------------------------------------------------------------------

ROWS = {
    "a": "MOP over the files, cache=None, decode_threads=1",
    "b": "MOP over the images decoded into arrays in memory (from_arrays)",
    "c": 'MOP, cache="disk" of the originals, random_transform (random crop, resized)',
    "d": "task parallelism: a process per trial, DataLoader(num_workers=1) over the files",
}


def markdown(result: dict) -> str:
    lines = [
        "# A search over image files: MOP against task parallelism",
        "",
        f"`{result['command']}` — {result['date']}. {result['images']:,} JPEGs of {SIZE}x{SIZE} "
        f"(+ {result['valid_images']:,} for validation) in {CLASSES} class folders, sorted by class; a small CNN, "
        f"{result['configs']} configurations (lr x width) x {result['epochs']} epochs, batch {BATCH}; "
        f"{result['workers']} workers pinned to cores {result['cpus']} ({result['cpu']}, {result['cores']} cores "
        f"on the machine, load average {result['load_average']:.1f} before the run). Samples/s: training samples "
        "per second of makespan (MOP: the Session, partitions loaded or shipped included; task parallelism: "
        "from the first trial's launch to the last one's end, each trial's process start and imports included; "
        "its DataLoader workers are forked). Peak RSS: per Dask worker process; for task parallelism, per trial "
        "process (+ its DataLoader workers', forked from it, so some pages are counted in both).",
        "",
        "<!-- --8<-- [start:table] -->",
        "| row | samples/s | makespan (s) | peak RSS per worker (MiB) | best val accuracy |",
        "|---|---|---|---|---|",
    ]
    for key, row in result["rows"].items():
        rss = f"{max(row['peak_rss_mib_per_worker']):,.0f}"
        if "loader_peak_rss_mib" in row:
            rss += f" (+ loader {max(row['loader_peak_rss_mib']):,.0f})"
        lines.append(f"| ({key}) {ROWS[key]} | {row['samples_per_s']:,.0f} | {row['makespan_s']:,.1f} | {rss} | "
                     f"{max(row['final_val_accuracy']):.3f} |")  # fmt: skip
    ratio = result.get("ratio_a_over_d")
    if ratio is not None:
        verdict = "met" if ratio >= GOAL else "not met"
        lines += ["", f"(a) / (d): **{ratio:.2f}x** the throughput of task parallelism "
                      f"(issue 45's goal: ≥ {GOAL}x, {verdict})."]  # fmt: skip
    lines += ["<!-- --8<-- [end:table] -->", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--configs", type=int, default=len(CONFIGS), help=f"at most {len(CONFIGS)}")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="Dask workers, trials at a time, and cores")
    parser.add_argument("--rows", default="a,b,c,d", help="which rows, comma-separated")
    parser.add_argument("--data", default="/tmp/cerebro-bench-files-search", help="the images' cache folder")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--trial", help=argparse.SUPPRESS)  # row (d): one trial, its job as JSON
    args = parser.parse_args()
    if args.trial:
        job = json.loads(args.trial)
        print(json.dumps(trial(job["config"], job["train_root"], job["valid_root"], job["epochs"], job["seed"])))
        return
    if not 1 <= args.configs <= len(CONFIGS):
        parser.error(f"--configs must be 1..{len(CONFIGS)}")
    rows = args.rows.split(",")
    if set(rows) - set(ROWS):
        parser.error(f"--rows takes some of {','.join(ROWS)}")
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < args.workers:
        parser.error(f"--workers {args.workers}, but this process may use {len(allowed)} cores")
    cpus = allowed[: args.workers]
    os.sched_setaffinity(0, cpus)  # before any thread or process starts: they all inherit it
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    train_root, valid_root = dataset_folders(Path(args.data), args.images)
    configs = CONFIGS[: args.configs]

    from cerebro_automl import PartitionedDataset

    def arrays(root: Path) -> tuple[np.ndarray, np.ndarray]:
        items = listing(root)
        return np.stack([decode(p).numpy() for p, _ in items]), np.array([c for _, c in items], dtype=np.int64)

    makers = {
        "a": lambda: PartitionedDataset.from_image_folder(
            train_root, args.workers, valid=valid_root, cache=None, decode_threads=1),
        "c": lambda: PartitionedDataset.from_image_folder(
            train_root, args.workers, valid=valid_root, cache="disk", random_transform=random_resized_crop),
    }  # fmt: skip
    if "b" in rows:
        X, y = arrays(train_root)
        valid = arrays(valid_root)
        makers["b"] = lambda: PartitionedDataset.from_arrays(X, y, args.workers, valid=valid)
    results: dict[str, dict] = {}
    for key in rows:
        if key == "d":
            row = task_parallel(train_root, valid_root, configs, args.epochs, args.workers)
        else:
            row = mop(makers[key], configs, args.epochs, args.workers)
        row["samples_per_s"] = args.images * args.epochs * len(configs) / row["makespan_s"]
        results[key] = row
        print(f"({key}) {ROWS[key]}: {row['samples_per_s']:,.0f} samples/s, makespan {row['makespan_s']:.1f} s, "
              f"peak RSS {row['peak_rss_mib_per_worker']} MiB, best val accuracy "
              f"{max(row['final_val_accuracy']):.3f}", flush=True)  # fmt: skip

    result = {
        "command": "python benchmarks/bench_files_search.py " + " ".join(sys.argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "images": args.images, "valid_images": max(CLASSES, args.images // 10), "size": SIZE,
        "configs": len(configs), "config_list": configs, "epochs": args.epochs, "batch": BATCH,
        "workers": args.workers, "cpus": cpus, "cores": os.cpu_count(), "load_average": load,
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "rows": results, "row_names": {k: ROWS[k] for k in results}, "goal": GOAL,
    }  # fmt: skip
    if "a" in results and "d" in results:
        result["ratio_a_over_d"] = results["a"]["samples_per_s"] / results["d"]["samples_per_s"]
        result["goal_met"] = result["ratio_a_over_d"] >= GOAL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "files_search.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "files_search.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
