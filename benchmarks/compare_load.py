"""Engine overhead before and after a change: the tiny-model load of bench_engine.py
run from two source trees, alternately, on this machine.

    git worktree add /tmp/before <commit>
    python benchmarks/compare_load.py /tmp/before . [--models 100] [--rounds 3] [--no-validation]

Each run is a fresh process with that tree's ``cerebro_automl`` first on
``sys.path`` (its worker processes inherit it) and this checkout's
``measure_load``, on its own LocalCluster of 2 workers, after a warm-up
session. It reports train units per second and the CPU seconds per train unit
of the driver process (our loop, the Dask client and, in a LocalCluster, the
Dask scheduler) and of the workers; medians over the rounds, and the ratio
after / before. Shared machines drift by 2x within an hour, so only the
alternating pairs are comparable, never figures from different runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json, logging, sys
tree, benchmarks, n, validation = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
sys.path[:0] = [tree, benchmarks]  # the library under test, this checkout's benchmark
import cerebro_automl
assert cerebro_automl.__file__.startswith(tree), cerebro_automl.__file__
import bench_engine
from distributed import Client
from cerebro_automl.executors.dask import start_local_cluster
logging.getLogger("cerebro_automl").setLevel(logging.WARNING)
logging.getLogger("distributed").setLevel(logging.ERROR)
if __name__ == "__main__":
    with start_local_cluster(2) as cluster, Client(cluster) as client:
        bench_engine.measure_load(client, 10, validation)
        print("RESULT " + json.dumps(bench_engine.measure_load(client, n, validation)))
"""


def run_once(tree: Path, models: int, validation: bool = True) -> dict:
    """One measure_load run of ``tree``'s code in a fresh process."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tree), str(ROOT / "benchmarks"), str(models),
                           str(int(validation))],
                          capture_output=True,
                          text=True, timeout=900, cwd=tree)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"the run of {tree} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-validation", action="store_true", help="data without validation rows")
    parser.add_argument("--out", default=None, help="write compare_load.{md,json} into this folder")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(run_once(tree, args.models, not args.no_validation))
            r = runs[name][-1]
            print(f"{name}: {r['train_units_per_s']:.1f} units/s, CPU per unit driver "
                  f"{r['driver_cpu_ms_per_unit']:.1f} ms, workers {r['workers_cpu_ms_per_unit']:.1f} ms", flush=True)
    figures = [("train units per second", "train_units_per_s", "{:.1f}"),
               ("driver CPU per unit (ms)", "driver_cpu_ms_per_unit", "{:.1f}"),
               ("workers' CPU per unit (ms)", "workers_cpu_ms_per_unit", "{:.1f}")]
    data = "no validation data" if args.no_validation else "with validation data"
    flag = " --no-validation" if args.no_validation else ""
    lines = [f"# Engine load, before and after ({args.models} tiny models x 3 epochs, 2 workers, {data})", "",
             f"`python benchmarks/compare_load.py {args.before} {args.after} --models {args.models} "
             f"--rounds {args.rounds}{flag}` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; medians of "
             f"{args.rounds} alternating runs each.", "",
             "<!-- --8<-- [start:table] -->", "| figure | before | after | after / before |", "|---|---|---|---|"]
    for label, key, fmt in figures:
        before = statistics.median(r[key] for r in runs["before"])
        after = statistics.median(r[key] for r in runs["after"])
        lines.append(f"| {label} | {fmt.format(before)} | {fmt.format(after)} | {after / before:.2f} |")
    lines.append("<!-- --8<-- [end:table] -->")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare_load.md").write_text(table + "\n")
        (out / "compare_load.json").write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()},
                                                           "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
