"""How fast a worker decodes images: 64x64 JPEGs from an image folder and from
WebDataset-style tar shards, decoded in the training thread or in decode threads.

    python benchmarks/bench_files.py [--images 4000] [--threads 0,1,2,4] [--out benchmarks/results]

The images are drawn from a seeded generator with Pillow (class subfolders, and the
same images in 8 tar shards). Torch computes on one thread (``torch.set_num_threads(1)``),
as a worker with one core does: PIL alone on one file; a partition's batches of 256
through ``from_image_folder`` and ``from_tar_shards`` with ``cache=None`` (decode and
collate every batch), in the training thread (``decode_threads=0``) and in 1, 2, 4
decode threads, a few batches ahead; the same batches from ``cache="memory"`` and
``cache="disk"`` (decoded once, when the partition loads, in the default decode
threads); what the driver spends listing the files; and one epoch of a small CNN,
training on arrays in memory against decoding every batch, serially and in threads.
Written to files.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy
from cerebro_automl.data.files import DECODE_THREADS

ROOT = Path(__file__).resolve().parents[1]
SIZE, CLASSES, SHARDS, BATCH = 64, 10, 8, 256


def draw(rng: np.random.Generator, label: int) -> np.ndarray:
    """A 64x64 RGB image: smooth noise with a class-dependent colour (JPEG-compressible)."""
    base = rng.integers(0, 256, (SIZE // 8, SIZE // 8, 3)).repeat(8, 0).repeat(8, 1)
    base[:, :, label % 3] = 40 + 20 * (label // 3)
    return np.clip(base + rng.integers(-16, 17, base.shape), 0, 255).astype(np.uint8)


def write_data(folder: Path, images: int) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    root, shards = folder / "images", folder / "shards"
    shards.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        tars = [stack.enter_context(tarfile.open(shards / f"train-{k:03d}.tar", "w")) for k in range(SHARDS)]
        _write(rng, root, tars, images)
    return root, shards


def _write(rng: np.random.Generator, root: Path, tars: list, images: int) -> None:
    from PIL import Image

    for n in range(images):
        label = n * CLASSES // images  # sorted by class, as folders are
        out = io.BytesIO()
        Image.fromarray(draw(rng, label)).save(out, "JPEG", quality=90)
        data = out.getvalue()
        (root / f"c{label}").mkdir(parents=True, exist_ok=True)
        (root / f"c{label}" / f"{n:06d}.jpg").write_bytes(data)
        tar = tars[n % SHARDS]
        for ext, payload in (("jpg", data), ("cls", str(label).encode())):
            info = tarfile.TarInfo(f"{n:06d}.{ext}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def rate(fn, items: int, repeat: int = 3) -> float:
    """Items per second, the best of ``repeat`` runs."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return items / best


def batches_per_second(data: PartitionedDataset, scratch: str) -> tuple[float, float]:
    """Images per second through a one-partition dataset's batches of 256 (a pass, read as
    training reads it: ahead, in the dataset's decode threads), and its load time."""
    start = time.perf_counter()
    [source] = data.resolve(1, 0).sources
    part = source.load(scratch=scratch)
    load = time.perf_counter() - start
    n = len(part.train)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    rows = [order[i : i + BATCH] for i in range(0, n, BATCH)]

    def epoch() -> None:
        for _ in part.train.read(rows):
            pass

    return rate(epoch, n, repeat=2), load


def cnn(config):
    w = config["width"]
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, w, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(2 * w, CLASSES),
    )  # fmt: skip


def normalise(x, y):
    return x.float() / 255 - 0.5, y


def epoch_rate(data: PartitionedDataset, images: int) -> float:
    spec = TrainingSpec(model_fn=cnn, optimizer_fn=lambda c, p: torch.optim.Adam(p, lr=1e-3),
                        metrics={"accuracy": accuracy}, batch_size=64, eval_transform=normalise,
                        train_transform=lambda x, y, g: normalise(x, y))  # fmt: skip
    with Session(spec, data, seed=0, executor="local", progress=False) as s:
        s.add({"width": 16}, epochs=2)
        s.run()
        h = s.history
    return images / float(h[h.epoch == 1].train_seconds.iloc[0]) if "train_seconds" in h else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--threads", default="0,1,2,4", help="decode_threads to measure, comma-separated")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    torch.set_num_threads(1)
    from PIL import Image

    work = Path(tempfile.mkdtemp(prefix="bench-files-"))
    scratch = str(work / "scratch")
    os.makedirs(scratch)
    root, shards = write_data(work, args.images)
    files = sorted(root.glob("*/*.jpg"))

    def pil_alone() -> None:
        for path in files:
            with Image.open(path) as im:
                np.asarray(im.convert("RGB"))

    rows: dict[str, dict] = {}
    rows["PIL alone: open and decode each file, in order"] = {"images_per_s": rate(pil_alone, len(files))}
    for name, make in (
        ("image folder", lambda **kw: PartitionedDataset.from_image_folder(root, 1, **kw)),
        ("tar shards", lambda **kw: PartitionedDataset.from_tar_shards(str(shards / "*.tar"), 1, **kw)),
    ):
        for threads in args.threads:
            per_s, load = batches_per_second(make(cache=None, decode_threads=threads), scratch)
            rows[f"{name}, cache=None, decode_threads={threads}: batches of {BATCH}"] = {
                "images_per_s": per_s, "load_s": load, "decode_threads": threads}  # fmt: skip
        for cache in ("memory", "disk"):
            per_s, load = batches_per_second(make(cache=cache), scratch)
            rows[f"{name}, cache={cache!r}: batches of {BATCH}"] = {
                "images_per_s": per_s, "load_s": load, "decode_threads": DECODE_THREADS}  # fmt: skip
    start = time.perf_counter()
    PartitionedDataset.from_image_folder(root, 1)
    listing = {"image folder": time.perf_counter() - start}
    start = time.perf_counter()
    PartitionedDataset.from_tar_shards(str(shards / "*.tar"), 1)
    listing["tar shards"] = time.perf_counter() - start

    train: dict[str, float] = {}
    train["small CNN, one epoch, cache='memory'"] = epoch_rate(
        PartitionedDataset.from_image_folder(root, 1, cache="memory"), args.images
    )
    for threads in sorted({0, DECODE_THREADS, *args.threads}):
        train[f"small CNN, one epoch, cache=None, decode_threads={threads}"] = epoch_rate(
            PartitionedDataset.from_image_folder(root, 1, decode_threads=threads), args.images
        )

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    cpu = platform.processor() or platform.machine()
    load = os.getloadavg()[0]
    lines = [
        "# Decoding image files",
        "",
        f"`python benchmarks/bench_files.py --images {args.images} --threads {','.join(map(str, args.threads))}` "
        f"— {when}. {args.images} JPEGs of {SIZE}x{SIZE} (quality 90) in {CLASSES} class folders and in "
        f"{SHARDS} tar shards, one partition, in one process ({cpu}, {os.cpu_count()} cores, torch threads 1); "
        "decoded in the training thread (`decode_threads=0`) or in decode threads a few batches ahead. "
        f"Best of 2-3 passes; the page cache warm; the load average was {load:.1f} "
        "(the cores are shared with other work), so figures vary by about 20%, and threads gain at most "
        "what the free cores allow.",
        "",
        "<!-- --8<-- [start:table] -->",
        "| what | decode threads | images/s | partition load (s) |",
        "|---|---|---|---|",
    ]
    for what, r in rows.items():
        load_s = f"{r['load_s']:.2f}" if "load_s" in r else ""
        threads = str(r["decode_threads"]) if "decode_threads" in r else ""
        lines.append(f"| {what} | {threads} | {r['images_per_s']:,.0f} | {load_s} |")
    for what, per_s in train.items():
        lines.append(f"| {what} (training throughput) | | {per_s:,.0f} | |")
    lines += [
        "<!-- --8<-- [end:table] -->",
        "",
        f"Listing on the driver ({args.images} files): image folder {listing['image folder']:.2f} s, "
        f"tar shards (member headers only) {listing['tar shards']:.2f} s.",
        "",
    ]
    out = Path(args.out)
    (out / "files.md").write_text("\n".join(lines))
    (out / "files.json").write_text(
        json.dumps({"date": when, "images": args.images, "size": SIZE, "batch": BATCH, "cores": os.cpu_count(),
                    "load_average": load, "rows": rows, "training_images_per_s": train, "listing_s": listing},
                   indent=2) + "\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
