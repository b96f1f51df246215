"""The fault campaign (benchmarks/bench_chaos.py) at test size: workers killed at
random every few seconds on a CLI cluster with nannies and a memory limit, with
a config that passes the limit, one that raises in its third unit, one that
hangs past unit_timeout, and 12 healthy ones. `make chaos` runs it longer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.mark.timeout(900)
def test_a_search_under_random_worker_kills_keeps_healthy_bits_and_fails_only_the_bad_configs():
    pytest.importorskip("mnist1d")
    pytest.importorskip("psutil")
    import bench_chaos

    record = bench_chaos.campaign(healthy=12, epochs=2, kill_every=6.0)
    print(bench_chaos._markdown(record, bench_chaos.passed(record)))
    assert bench_chaos.passed(record) == []
    assert record["healthy_total"] == 12 and record["kills"] >= 3
