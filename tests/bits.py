"""Fixed runs whose results must not change bit for bit while the code is
restructured: a Session on the local and the Dask executor, Optuna, Hyperband,
PBT, Lightning, and replicas with speculation. Each run gives a digest of the
weights (and metrics) it ends with; ``tests/bits.json`` holds the recorded ones.

The digests are recorded under a label naming the CPU, its kernel capability and
the torch version. The package pins the CPU kernels to AVX2 (cerebro_automl.cpu_kernels),
so every x86-64 machine must give the same digests: on a machine that has a record,
each run must give that record's digest; on one that has none, the digest recorded
on some machine.

    python tests/bits.py            # compare every run against tests/bits.json
    python tests/bits.py --record   # record this machine's digests (before a change,
                                    # or for a deliberate change of the bits)
    python tests/bits.py session    # just the runs named

``tests/test_bits.py`` runs the comparison in the test suite.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import platform
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from conftest import make_arrays  # noqa: E402
from models import CONFIGS, make_spec  # noqa: E402

from cerebro_automl import PartitionedDataset, Session  # noqa: E402

RECORD = HERE / "bits.json"


def _digest(obj: Any) -> str:
    """A digest of nested dicts/lists of tensors, arrays and plain values, in a fixed order."""
    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                feed(v)
            h.update(b"]")
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(str(t.dtype).encode() + repr(tuple(t.shape)).encode())
            h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes())
        elif isinstance(x, np.ndarray):
            h.update(x.tobytes())
        elif isinstance(x, float):
            h.update(float(x).hex().encode())
        else:
            h.update(repr(x).encode())

    feed(obj)
    return h.hexdigest()[:16]


def _data(partitions: int = 3) -> PartitionedDataset:
    # The rows in their given order: the partitions these digests were first recorded with.
    X, y, Xv, yv = make_arrays()
    return PartitionedDataset.from_arrays(X, y, num_partitions=partitions, valid=(Xv, yv), shuffle=False)


def _session_run(**kwargs: Any) -> str:
    with Session(make_spec(), _data(), seed=7, **kwargs) as s:
        ids = [s.add(c, epochs=3) for c in CONFIGS]
        history = s.run()
        weights = {i: s.model(i).state()["model"] for i in ids}
        metrics = sorted((int(r.model_id), int(r.epoch), float(r.val_loss), float(r.train_loss))
                         for r in history.itertuples())
    return _digest({"weights": weights, "metrics": metrics})


def session_local() -> str:
    return _session_run(executor="local")


def session_dask() -> str:
    return _session_run(n_workers=2)


def replicas_speculate() -> str:
    return _session_run(n_workers=3, replicas=2, speculate=True, prefetch=True)


def optuna_search() -> str:
    import optuna

    from cerebro_automl.adapters.optuna import optimize

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3),
                                pruner=optuna.pruners.NopPruner())

    def space(trial):
        return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True),
                "width": trial.suggest_categorical("width", [8, 16])}

    optimize(study, make_spec(), _data(), space, n_trials=4, epochs=2, metric="val_loss",
             executor="local", seed=5)
    return _digest([(t.number, t.params, t.intermediate_values, t.value) for t in study.trials])


def hyperband_search() -> str:
    from cerebro_automl.adapters.hyperband import hyperband

    def sampler(rng):
        return {"lr": float(10 ** rng.uniform(-3, -1)), "width": int(rng.choice([8, 16]))}

    result = hyperband(make_spec(), _data(), sampler, max_epochs=3, eta=3, seed=2, executor="local")
    return _digest({"best": (result.best_config, result.best_value), "state": _trained(result.best_state),
                    "history": _frame(result.history)})


def pbt_search() -> str:
    from cerebro_automl.adapters.pbt import pbt

    def sampler(rng):
        return {"lr": float(10 ** rng.uniform(-3, -1)), "width": 8}

    result = pbt(make_spec(), _data(), sampler, population=4, epochs=3, interval=1,
                 mutations={"lr": (1e-4, 1.0)}, seed=1, executor="local")
    return _digest({"best": (result.best_config, result.best_value), "state": _trained(result.best_state),
                    "history": _frame(result.history)})


def lightning_run() -> str:
    from cerebro_automl.adapters.lightning import LightningSpec
    from lightning_modules import classifier

    with Session(LightningSpec(classifier, batch_size=32), _data(), seed=3, executor="local") as s:
        ids = [s.add({"lr": lr}, epochs=2) for lr in (0.01, 0.05)]
        history = s.run()
        weights = {i: s.model(i).state()["model"] for i in ids}
    return _digest({"weights": weights, "history": _frame(history)})


def _trained(state: dict) -> dict:
    """The parts of a model state that training computes (not its timing)."""
    return {k: state[k] for k in ("model", "optimizer", "scheduler", "samples", "steps")}


def _frame(history: Any) -> list:
    """The numeric columns of a history, sorted, as plain values."""
    cols = sorted(c for c in history.columns if c.startswith(("train_", "val_")) and not c.endswith("_seconds")
                  or c in ("model_id", "epoch"))
    rows = history[cols].sort_values(["model_id", "epoch"], kind="stable")
    return [cols] + [[float(v) for v in row] for row in rows.itertuples(index=False)]


RUNS: dict[str, Callable[[], str]] = {
    "session_local": session_local, "session_dask": session_dask,
    "replicas_speculate": replicas_speculate, "optuna": optuna_search,
    "hyperband": hyperband_search, "pbt": pbt_search, "lightning": lightning_run,
}


@functools.cache
def machine() -> str:
    """The label this machine's digests are recorded under."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
                 if ln.startswith("model name")]
        model = names[0] if names else model
    return (f"{model}, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
            f"kernels {_kernel_fingerprint()}")


def _kernel_fingerprint() -> str:
    """A digest of a few small products and reductions: two CPUs that share a model name
    can still pick other kernels, and then this differs."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, 129, generator=g), torch.randn(129, 53, generator=g)
    x, w = torch.randn(4, 3, 101, generator=g), torch.randn(8, 3, 5, generator=g)
    parts = [a @ b, torch.nn.functional.conv1d(x, w), a.exp().sum(1), torch.softmax(a, 1)]
    return hashlib.sha256(b"".join(p.numpy().tobytes() for p in parts)).hexdigest()[:8]


def expected(name: str, recorded: dict[str, dict[str, str]]) -> set[str]:
    """The digests run ``name`` may give here: this machine's record, else any machine's."""
    here = recorded.get(machine())
    if here is not None:
        return {here[name]} if name in here else set()
    return {digests[name] for digests in recorded.values() if name in digests}


def main(argv: list[str]) -> int:
    record = "--record" in argv
    names = [a for a in argv if not a.startswith("-")] or list(RUNS)
    recorded = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    print(f"machine: {machine()}" + ("" if machine() in recorded else " (no record; any machine's digest passes)"))
    bad = []
    mine = dict(recorded.get(machine(), {}))
    for name in names:
        got = RUNS[name]()
        want = expected(name, recorded)
        print(f"{name:20s} {got}  {'ok' if got in want else f'DIFFERS (recorded {sorted(want)})'}", flush=True)
        if got not in want:
            bad.append(name)
        mine[name] = got
    if record:
        recorded[machine()] = mine
        RECORD.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
