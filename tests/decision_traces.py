"""Decision traces: digests of the full instruction stream of 400 seeded churn runs
(every event kind, stale deliveries, timing, speculation, prefetch, lost and joining
workers) and of 24 simulator runs, recorded in tests/decision_traces.json. A change
that moves engine code without changing a decision keeps every digest:

    PYTHONHASHSEED=0 python tests/decision_traces.py check
    PYTHONHASHSEED=0 python tests/decision_traces.py record   # a deliberate change

Unlike tests/bits.py (the weights, which a fixed visit order keeps whatever the
engine decides), these catch any change in which unit runs where and when.
"""

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import test_scheduler as T


def churn(seed: int) -> str:
    """The digest of test_scheduler's churn run ``seed``: every event and what the
    engine answered, in order."""
    h = hashlib.sha256()

    class Recording(T.Driver):
        def start(self) -> list:
            out = super().start()
            h.update(repr(T.as_tuples(out)).encode())
            return out

        def send(self, event) -> list:
            out = super().send(event)
            h.update(repr(event).encode())
            h.update(repr(T.as_tuples(out)).encode())
            return out

    driver, T.Driver = T.Driver, Recording
    try:
        d = T.churn_run(seed)
    finally:
        T.Driver = driver
    h.update(repr((d.s.units_trained, d.s.copies_started, d.s.restarts)).encode())
    return h.hexdigest()[:16]


def sims():
    from cerebro_automl.simulate import Stragglers, simulate

    out = {}
    for p in (4, 8):
        for order in ("fixed", "dynamic"):
            for r, spec in ((1, False), (2, True), (3, True)):
                for joins in ((), (3.0,)):
                    costs = [1.0 + 0.1 * (i % 5) for i in range(2 * p)]
                    res = simulate(
                        costs,
                        p,
                        epochs=2,
                        order=order,
                        replicas=r,
                        speculate=spec,
                        seed=1,
                        stragglers=Stragglers(slow_workers=1, slowdown=4.0, unit_rate=0.05),
                        prefetch=spec,
                        joins=joins,
                        validate=True,
                        eval_costs=0.2,
                        hop=0.05,
                    )
                    out[f"sim-{p}-{order}-{r}-{len(joins)}"] = repr(
                        (res.makespan, res.copies, res.restarts, res.wasted)
                    )
    return out


if __name__ == "__main__":
    got = {f"churn-{s}": churn(s) for s in range(400)}
    try:
        got.update(sims())
    except Exception as e:
        print("sims failed:", repr(e))
    path = Path(__file__).parent / "decision_traces.json"
    if sys.argv[1] == "record":
        path.write_text(json.dumps(got, indent=0) + "\n")
        print("recorded", len(got))
    else:
        want = json.loads(path.read_text())
        bad = [k for k in want if got.get(k) != want[k]]
        print("differ:", bad[:20], len(bad), "of", len(want))
        sys.exit(1 if bad else 0)
