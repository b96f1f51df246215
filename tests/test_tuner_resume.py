"""A tuner's driver killed at any point and started again with the same call
continues from its checkpoints: its rungs, promotions, population or trials go on,
it ends with the results of a run never interrupted (bitwise, reproducible=True),
and it trains none of the epochs that were checkpointed and reported before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
DRIVER = HERE / "tuner_resume_driver.py"
# Reports before the kill: about half of each search's.
KILL_AFTER = {"asha": 3, "hyperband": 6, "pbt": 4, "grid": 3, "random": 3, "hyperopt": 3}  # reports journaled


def _start(tuner: str, folder: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(HERE))
    return subprocess.Popen([sys.executable, str(DRIVER), tuner, str(folder)], env=env, cwd=HERE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _journaled(folder: Path) -> dict[Path, int]:
    """The checkpoint files whose epoch the journal holds too: path -> mtime."""
    out = {}
    for journal in (folder / "ckpt").glob("*/reports.jsonl"):
        epochs = {json.loads(line)["epoch"] for line in journal.read_text().splitlines() if line.endswith("}")}
        for epoch in epochs:
            path = journal.parent / f"epoch-{epoch}.json"
            if path.exists() and path.with_suffix(".pt").exists():
                out[path] = path.stat().st_mtime_ns
    return out


def _reports(folder: Path) -> int:
    return sum(len([line for line in p.read_text().splitlines() if line]) for p in (folder / "ckpt").glob("*/reports.jsonl"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tuner", list(KILL_AFTER))
def test_a_killed_tuner_continues_from_its_checkpoints_with_the_same_results(tmp_path, tuner):
    (tmp_path / "straight").mkdir()
    straight = _start(tuner, tmp_path / "straight")
    killed = _start(tuner, tmp_path)
    try:
        deadline = time.time() + 120
        while killed.poll() is None and time.time() < deadline and _reports(tmp_path) < KILL_AFTER[tuner]:
            time.sleep(0.02)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
        assert straight.wait(timeout=240) == 0, straight.stderr.read()[-3000:]
    finally:
        killed.kill()
        straight.kill()
    assert not (tmp_path / "result.json").exists(), "the search finished before it could be killed"
    kept = _journaled(tmp_path)
    assert kept, "nothing was checkpointed and reported before the kill"
    again = _start(tuner, tmp_path)
    assert again.wait(timeout=240) == 0, again.stderr.read()[-3000:]
    resumed = json.loads((tmp_path / "result.json").read_text())
    assert resumed == json.loads((tmp_path / "straight" / "result.json").read_text())
    retrained = [p.relative_to(tmp_path) for p, mtime in kept.items() if p.stat().st_mtime_ns != mtime]
    assert not retrained, f"{len(retrained)} of {len(kept)} epochs trained again: {retrained}"
