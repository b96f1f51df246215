"""The fixed runs of tests/bits.py give the weights and metrics recorded in
tests/bits.json, bit for bit: a change that moves code keeps every result."""

from __future__ import annotations

import json

import pytest

import bits


@pytest.mark.cluster
@pytest.mark.parametrize("name", list(bits.RUNS))
def test_fixed_run_keeps_its_bits(name):
    recorded = json.loads(bits.RECORD.read_text())
    assert bits.RUNS[name]() in bits.expected(name, recorded), (
        f"the fixed run {name!r} no longer gives the bits recorded for {bits.machine()!r}; if the "
        "change is deliberate, re-record with: python tests/bits.py --record")
