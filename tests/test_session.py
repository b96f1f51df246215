"""The Session on the in-process executor: the tuner-facing contract."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest
import torch

from cerebro_automl import EpochReport, ModelFailed, ModelPaused, PartitionedDataset, Session
from cerebro_automl.checkpoint import latest_checkpoint, load_checkpoint
from cerebro_automl.executors.base import partition_count

from models import CONFIGS, make_spec


def _weights(session, model_id):
    return session.model(model_id).state()["model"]


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_reports_come_per_epoch_in_order_then_finished(spec, data):
    with Session(spec, data, executor="local", n_workers=2) as s:
        ids = [s.add(c, epochs=3) for c in CONFIGS]
        reports = list(s.reports())
    for mid in ids:
        mine = [r for r in reports if r.model_id == mid]
        assert [r.epoch for r in mine if isinstance(r, EpochReport)] == [1, 2, 3]
        assert isinstance(mine[-1], ModelPaused) and mine[-1].epochs == 3
        assert set(mine[0].metrics) == {"train_loss", "train_seconds", "val_loss",
                                        "val_accuracy", "val_seconds"}


def test_history_has_one_row_per_model_epoch_with_replay_keys(spec, data):
    with Session(spec, data, executor="local", seed=3) as s:
        for c in CONFIGS:
            s.add(c, epochs=2)
        h = s.run()
    assert len(h) == len(CONFIGS) * 2
    assert {"model_id", "epoch", "val_loss", "config", "seed", "offset", "order",
            "num_partitions", "threads", "session_seed"} <= set(h.columns)
    assert all(sorted(o) == [0, 1, 2] for o in h["order"])
    assert (h["session_seed"] == 3).all() and (h["threads"] == 1).all()


def test_training_learns(spec, data):
    with Session(spec, data, executor="local") as s:
        s.add({"lr": 1e-2, "width": 16}, epochs=8)
        h = s.run()
    assert h["val_accuracy"].iloc[-1] > 0.8 > h["val_accuracy"].iloc[0] - 0.2
    assert h["train_loss"].iloc[-1] < h["train_loss"].iloc[0]


def test_pause_then_extend_equals_training_straight_through(spec, data):
    config = {"lr": 1e-2, "width": 8}
    with Session(spec, data, executor="local") as s:
        paused = s.add(config, epochs=2, offset=0)
        s.run()
        assert s.status(paused) == "paused"
        s.extend(paused, epochs=2)
        s.run()
        resumed = _weights(s, paused)
    with Session(spec, data, executor="local") as s:
        straight = s.add(config, epochs=4)
        s.run()
        assert _same(resumed, _weights(s, straight))


def test_stop_prunes_a_model_and_the_others_finish(spec, data):
    with Session(spec, data, executor="local", n_workers=3) as s:
        ids = [s.add(c, epochs=3) for c in CONFIGS]
        for r in s.reports():
            if isinstance(r, EpochReport) and r.model_id == ids[1] and r.epoch == 1:
                s.stop(ids[1])
        h = s.history
        assert s.status(ids[1]) == "stopped"
        assert h[h.model_id == ids[1]].epoch.max() == 1
        assert all(s.status(i) == "paused" for i in ids if i != ids[1])
        with pytest.raises(ValueError, match="stopped"):
            s.extend(ids[1], epochs=1)


def test_a_failing_model_does_not_take_down_the_others(data):
    def model_fn(config):
        if config["width"] == 13:
            raise RuntimeError("width 13 is unlucky")
        return torch.nn.Linear(8, 3)

    spec = make_spec(model_fn=model_fn)
    with Session(spec, data, executor="local") as s:
        bad = s.add({"lr": 1e-2, "width": 13}, epochs=2)
        good = s.add({"lr": 1e-2, "width": 8}, epochs=2)
        reports = list(s.reports())
        failed = [r for r in reports if isinstance(r, ModelFailed)]
        assert [r.model_id for r in failed] == [bad]
        assert "width 13 is unlucky" in failed[0].error
        assert s.status(bad) == "failed" and s.status(good) == "paused"
        assert s.model(bad).error is not None


def test_nan_loss_fails_only_that_model(data):
    def model_fn(config):
        layer = torch.nn.Linear(8, 3)
        if config["lr"] > 1:  # a diverging configuration
            torch.nn.init.constant_(layer.weight, float("inf"))
        return layer

    with Session(make_spec(model_fn=model_fn), data, executor="local") as s:
        bad = s.add({"lr": 10.0, "width": 8}, epochs=1)
        good = s.add({"lr": 1e-2, "width": 8}, epochs=1)
        reports = list(s.reports())
    failed = [r for r in reports if isinstance(r, ModelFailed)]
    assert [r.model_id for r in failed] == [bad] and "loss is nan" in failed[0].error
    assert any(isinstance(r, ModelPaused) and r.model_id == good for r in reports)


def test_best_and_build(spec, data):
    with Session(spec, data, executor="local") as s:
        for c in CONFIGS:
            s.add(c, epochs=2)
        h = s.run()
        best = s.best("val_accuracy", mode="max")
        last = h[h.epoch == 2].set_index("model_id")["val_accuracy"]
        assert best.metrics["val_accuracy"] == last.max()
        worst = s.best("val_accuracy", mode="min")
        assert worst.metrics["val_accuracy"] == last.min()
        module = best.build()
        assert _same({k: v for k, v in module.state_dict().items()}, _weights(s, best.model_id))
        with pytest.raises(ValueError, match="no model has reported metric 'val_f1'"):
            s.best("val_f1")


def test_a_model_replays_alone_from_its_recorded_offset(spec, data):
    with Session(spec, data, executor="local", seed=11) as s:
        ids = [s.add(c, epochs=2) for c in CONFIGS]
        h = s.run()
        target = ids[2]
        expected = _weights(s, target)
        row = h[h.model_id == target].iloc[0]
    with Session(spec, data, executor="local", seed=int(row.session_seed)) as s:
        alone = s.add(row.config, epochs=2, offset=int(row.offset))
        s.run()
        assert _same(expected, _weights(s, alone))


def test_dynamic_order_visits_every_partition_each_epoch(spec, data):
    with Session(spec, data, executor="local", n_workers=2, order="dynamic") as s:
        for c in CONFIGS:
            s.add(c, epochs=2)
        h = s.run()
    assert len(h) == 8 and all(sorted(o) == [0, 1, 2] for o in h["order"])


def test_add_inside_the_report_loop_keeps_the_hopper_full(spec, data):
    with Session(spec, data, executor="local", n_workers=2) as s:
        s.add(CONFIGS[0], epochs=1)
        added = 1
        for r in s.reports():
            if isinstance(r, ModelPaused) and added < 4:
                s.add(CONFIGS[added], epochs=1)
                added += 1
        assert len(s.history) == 4


def test_checkpoints_are_written_and_load_with_weights_only(spec, data, tmp_path, caplog):
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path)) as s:
        mid = s.add(CONFIGS[0], epochs=2)
        s.run()
        final = _weights(s, mid)
    state, meta = load_checkpoint(tmp_path, f"model-{mid}", 2)
    assert _same(state["model"], final) and meta["config"] == CONFIGS[0]
    # a corrupt newest checkpoint is detected and the previous one is used
    (tmp_path / f"model-{mid}" / "epoch-2.pt").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="cerebro_automl"):
        state, meta = latest_checkpoint(tmp_path, f"model-{mid}")
    assert meta["epoch"] == 1
    assert f"the checkpoint of model-{mid} after epoch 2 in {tmp_path} cannot be read" in caplog.text  # not silently


def test_closed_session_refuses_work(spec, data):
    s = Session(spec, data, executor="local")
    s.add(CONFIGS[0], epochs=1)
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.add(CONFIGS[0], epochs=1)
    # run() returned the history, reports() nothing, and `with` was allowed (issue 34, item 12)
    for call in (s.run, s.reports, s.next_reports, s.__enter__):
        with pytest.raises(RuntimeError, match="^the session is closed$"):
            call()
    with pytest.raises(RuntimeError, match="^the session is closed$"):
        with s:
            pass


def test_closing_the_session_inside_the_report_loop_ends_the_loop(spec, data):
    with Session(spec, data, executor="local") as s:
        s.add(CONFIGS[0], epochs=3)
        seen = []
        for r in s.reports():
            seen.append(r)
            s.close()
    assert len(seen) == 1


def test_no_validation_data_reports_train_loss_only(spec, arrays):
    X, y, _, _ = arrays
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2)
    with Session(spec, data, executor="local") as s:
        s.add(CONFIGS[0], epochs=1)
        h = s.run()
    assert "train_loss" in h.columns and "val_loss" not in h.columns
    assert np.isfinite(h["train_loss"]).all()


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(spec, data, tmp_path):
    config = CONFIGS[1]
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path)) as s:
        mid = s.add(config, epochs=4, name="trial-7")
        h_straight = s.run()
        straight = _weights(s, mid)
    state, meta = load_checkpoint(tmp_path, "trial-7", 2)
    with Session(spec, data, executor="local") as s:
        again = s.add(meta["config"], epochs=4, offset=meta["offset"], resume=(2, state))
        h = s.run()
        assert list(h.epoch) == [3, 4]  # only the epochs after the checkpoint
        assert _same(straight, _weights(s, again))
        assert h.val_loss.tolist() == h_straight.val_loss.tolist()[2:]


def test_resume_of_a_finished_model_whose_checkpoint_before_the_last_is_corrupt_goes_back_further(
        spec, data, tmp_path):
    """Without a reports journal (checkpoints of an older version), a model checkpointed
    after all its epochs resumes one epoch back, to report the last epoch again; when
    that checkpoint is corrupt it goes back to the newest valid one (Session.add raised
    "fails its checksum"), and the weights still equal a straight run. With the journal
    it trains nothing, and a corrupt newest checkpoint is passed over the same way."""
    config = CONFIGS[1]
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path)) as s:
        mid = s.add(config, epochs=3, name="m")
        reported = s.run()
        straight = _weights(s, mid)
    for epoch in (3, 2):  # the journal passes over the corrupt newest; the old path, over the one before
        state_file, meta_file = tmp_path / "m" / f"epoch-{epoch}.pt", tmp_path / "m" / f"epoch-{epoch}.json"
        original, meta = state_file.read_bytes(), meta_file.read_bytes()
        state_file.write_bytes(original[:100])
        with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
            again = s.add(config, epochs=3, name="m")
            history = s.run()
            assert list(history.epoch) == [1, 2, 3]
            assert (s.scheduler.units_trained > 0) == (epoch == 3)  # the last epoch trains again
            assert history.val_loss.tolist() == reported.val_loss.tolist()
            assert _same(straight, _weights(s, again))
        state_file.write_bytes(original)
        meta_file.write_bytes(meta)  # (a rewrite of the checkpoint has its own checksum)
    (tmp_path / "m" / "reports.jsonl").unlink()
    state_file = tmp_path / "m" / "epoch-2.pt"
    state_file.write_bytes(state_file.read_bytes()[:100])
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
        again = s.add(config, epochs=3, name="m")
        assert list(s.run().epoch) == [2, 3]
        assert _same(straight, _weights(s, again))


def test_resume_of_a_finished_model_checks_the_checkpoint_it_goes_back_to(spec, data, tmp_path):
    """A finished model resumes from the checkpoint before its last epoch, and that one
    is checked against the model too: one left by a run of another config is refused
    (it was loaded unchecked, since only the newest was compared)."""
    for folder, config in (("mine", CONFIGS[1]), ("other", CONFIGS[2])):
        with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path / folder)) as s:
            s.add(config, epochs=3, name="m")
            s.run()
    for suffix in ("pt", "json"):
        (tmp_path / "mine" / "m" / f"epoch-2.{suffix}").write_bytes(
            (tmp_path / "other" / "m" / f"epoch-2.{suffix}").read_bytes())
    (tmp_path / "mine" / "m" / "reports.jsonl").unlink()  # the path without a journal
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path / "mine"), resume=True) as s:
        with pytest.raises(ValueError, match=r"checkpoint 'm' in .* was written by another run .*config"):
            s.add(CONFIGS[1], epochs=3, name="m")
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path / "other"), resume=True) as s:
        with pytest.raises(ValueError, match=r"checkpoint 'm' in .* was written by another run .*config"):
            s.add(CONFIGS[1], epochs=3, name="m")  # the journal's path checks it too


def test_resume_and_name_are_checked(spec, data):
    with Session(spec, data, executor="local") as s:
        s.add(CONFIGS[0], epochs=1, name="a")
        with pytest.raises(ValueError, match="name is 'a'"):
            s.add(CONFIGS[0], epochs=1, name="a")
        with pytest.raises(ValueError, match="resume is"):
            s.add(CONFIGS[0], epochs=2, resume=(2, {"model": {}}))


@pytest.mark.timeout(300)
def test_a_killed_session_driver_continues_from_its_checkpoints(tmp_path, caplog):
    """SIGKILL a driver process mid-run; start it again with resume=True: it continues
    after each model's newest checkpoint, and the final weights equal an uninterrupted run.
    While the driver lives, its checkpoint_dir is refused to another session; once it is
    killed, its lock is taken over. Its checkpoints (on Dask) record the data's
    fingerprint, which the resume (local) finds equal."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    here = Path(__file__).parent
    sys.path.insert(0, str(here))
    import session_driver as driver

    env = dict(os.environ, PYTHONPATH=str(here))
    proc = subprocess.Popen([sys.executable, str(here / "session_driver.py"), str(tmp_path)], env=env)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
            done = list((tmp_path / "ckpt").glob("*/epoch-2.json"))
            if len(done) >= 2:
                break
        with pytest.raises(RuntimeError, match=rf"checkpoint_dir .* is in use by run \w+ \(pid {proc.pid} "):
            Session(make_spec(), _data_for_resume(), executor="local", checkpoint_dir=str(tmp_path / "ckpt"))
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert not (tmp_path / "weights.pt").exists(), "the driver finished before it could be killed"
    checkpointed = {p.parent.name: max(int(q.stem.split("-")[1]) for q in p.parent.glob("epoch-*.json"))
                    for p in (tmp_path / "ckpt").glob("*/epoch-1.json")}
    assert checkpointed and min(checkpointed.values()) < driver.EPOCHS

    import json
    meta = json.loads(next((tmp_path / "ckpt").glob("*/epoch-1.json")).read_text())
    assert len(meta["data"]) == 2 and all(p["train"]["sampled"] > 0 for p in meta["data"])
    resumed = driver.run(tmp_path, executor="local")  # the same session, started again
    assert f"taking over the lock of run {meta['run_id']} (pid {proc.pid}" in caplog.text
    [history] = [pd.read_csv(p) for p in tmp_path.glob("history-*.csv")]
    import re
    continued = {m: int(e) for m, e in re.findall(r"model '(model-\d+)' continues after epoch (\d+)", caplog.text)}
    for name, epoch in checkpointed.items():  # only the epochs after each checkpoint trained again
        model_id = int(name.split("-")[1])
        # (the newest checkpoint's report may not have been journaled when the driver died)
        assert continued.get(name, 0) >= epoch - 1, (name, epoch, continued)
        assert sorted(history[history.model_id == model_id].epoch) == list(range(1, driver.EPOCHS + 1))
    (tmp_path / "fresh").mkdir()
    straight = driver.run(tmp_path / "fresh", executor="local")
    for i in straight:
        assert _same(resumed[i], straight[i])
    [_, fresh] = sorted(tmp_path.glob("**/history-*.csv"), key=lambda p: "fresh" in str(p))
    assert history.val_loss.sort_values().tolist() == pd.read_csv(fresh).val_loss.sort_values().tolist()
    with pytest.raises(ValueError, match=r"checkpoint 'model-0' in .* was written by another run"):
        with Session(make_spec(), _data_for_resume(), seed=99, executor="local",
                     checkpoint_dir=str(tmp_path / "ckpt"), resume=True) as s:
            s.add(CONFIGS[0], epochs=driver.EPOCHS)


def _data_for_resume():
    from conftest import make_arrays
    X, y, Xv, yv = make_arrays()
    return PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))


def test_the_history_keeps_the_reason_a_model_failed(data):
    def model_fn(config):
        if config["width"] == 13:
            raise RuntimeError("width 13 is unlucky")
        return torch.nn.Linear(8, 3)
    with Session(make_spec(model_fn=model_fn), data, executor="local") as s:
        bad = s.add({"lr": 1e-2, "width": 13}, epochs=2)
        good = s.add({"lr": 1e-2, "width": 8}, epochs=2)
        h = s.run()
    failed = h[h.model_id == bad]
    assert len(failed) == 1 and failed.epoch.iloc[0] == 1 and failed.val_loss.isna().all()
    assert failed.error.iloc[0] == "RuntimeError: width 13 is unlucky"
    assert h[h.model_id == good].error.isna().all() and list(h[h.model_id == good].epoch) == [1, 2]


# ------------------------------------- issue 34, item 1: one live session per checkpoint_dir
def test_a_second_live_session_on_a_checkpoint_dir_is_refused_and_a_later_one_resumes(spec, data, tmp_path):
    """Two searches on one checkpoint_dir overwrote each other's checkpoints: the second
    live session is refused at once, naming the directory and the run that holds it;
    once the first closes (also when it failed), a later session takes it and resumes."""
    from cerebro_automl.checkpoint_dir import CheckpointDirInUse

    folder = str(tmp_path / "ck")
    first = Session(spec, data, executor="local", checkpoint_dir=folder)
    first.add(CONFIGS[0], epochs=2)
    first.run()
    run = first._directory.run
    with pytest.raises(CheckpointDirInUse, match=rf"checkpoint_dir '{folder}' is in use by run {run.run_id} "
                                                 rf"\(pid {run.pid} on host {run.host}, started .*\): one live "
                                                 "session at a time"):
        Session(spec, data, executor="local", checkpoint_dir=folder, resume=True)
    first.close()
    assert not (tmp_path / "ck" / ".lock").exists()
    with pytest.raises(ZeroDivisionError):
        with Session(spec, data, executor="local", checkpoint_dir=folder):
            1 / 0  # a session that fails gives the directory up too
    with Session(spec, data, executor="local", checkpoint_dir=folder, resume=True) as s:
        s.add(CONFIGS[0], epochs=3)
        assert list(s.run().epoch) == [1, 2, 3]  # 1-2 replayed from the journal, 3 trained
        assert s.scheduler.units_trained == partition_count(s.data)
    assert latest_checkpoint(folder, "model-0")[1]["run_id"] == s._directory.run.run_id


def test_the_lock_of_a_process_that_is_gone_is_taken_over_with_a_log_line(spec, data, tmp_path, caplog):
    import json
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    pid = int(dead.stdout)
    (tmp_path / ".lock").write_text(json.dumps({"run_id": "deadbeef0000", "host": __import__("socket").gethostname(),
                                                "pid": pid, "started": "earlier"}))
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path)) as s:
        assert json.loads((tmp_path / ".lock").read_text())["run_id"] == s._directory.run.run_id
    assert f"taking over the lock of run deadbeef0000 (pid {pid}" in caplog.text
    # a lock of another host whose lease is renewed is refused, saying when it would lapse
    (tmp_path / ".lock").write_text(json.dumps({"run_id": "0ther", "host": "elsewhere", "pid": 1,
                                                "started": "earlier"}))
    with pytest.raises(RuntimeError, match=r"in use by run 0ther \(pid 1 on host elsewhere.*taken over once 60 s"):
        Session(spec, data, executor="local", checkpoint_dir=str(tmp_path))


def test_a_lock_of_another_host_whose_lease_lapsed_is_taken_over_and_a_live_one_is_renewed(tmp_path, caplog):
    """A driver killed on one node and resubmitted on another: the old lock is taken over
    once its lease lapsed (by the file system's clock), with no file deleted by hand."""
    import json
    import os
    import time

    from cerebro_automl.checkpoint_dir import CheckpointDirectory, CheckpointDirInUse

    lock = tmp_path / ".lock"
    lock.write_text(json.dumps({"run_id": "0ther", "host": "node-7", "pid": 1, "started": "earlier"}))
    with pytest.raises(CheckpointDirInUse):
        CheckpointDirectory(tmp_path, lease=30)
    os.utime(lock, (time.time() - 31, time.time() - 31))
    taken = CheckpointDirectory(tmp_path, lease=30)
    assert "taking over the lock of run 0ther (pid 1 on host node-7" in caplog.text and "lease lapsed" in caplog.text
    taken.release()
    held = CheckpointDirectory(tmp_path, lease=0.6)  # renewed every 0.1 s
    try:
        os.utime(lock, (time.time() - 30, time.time() - 30))
        time.sleep(0.5)
        assert time.time() - lock.stat().st_mtime < 0.4
    finally:
        held.release()
    assert not lock.exists()


# ---------------------------------------- issue 34, item 2: a resume checks the data
def _trained(spec, folder, data, epochs=2):
    with Session(spec, data, executor="local", checkpoint_dir=str(folder)) as s:
        s.add(CONFIGS[0], epochs=epochs)
        s.run()


@pytest.mark.parametrize("change, differs", [
    (lambda X, y, Xv: (3 * X, y, Xv), r"partition 0: training content differs \(a digest of \d+ sampled "
                                      r"rows\); partition 1: training content differs"),
    (lambda X, y, Xv: (X[:-30], y[:-30], Xv), r"partition 0: training rows: 200 in the checkpoint, 190 now"),
    (lambda X, y, Xv: (X.astype(np.float16), y, Xv.astype(np.float16)),
     r"partition 0: training X dtype float32 in the checkpoint, float16 now; partition 0: validation X dtype"),
    (lambda X, y, Xv: (np.hstack([X, X]), y, np.hstack([Xv, Xv])),
     r"partition 0: training X row shape \(8,\) in the checkpoint, \(16,\) now"),
    (lambda X, y, Xv: (X, y, Xv[::-1].copy()), r"partition 0: validation content differs"),
])
def test_a_resume_on_other_data_is_refused_naming_what_differs(spec, arrays, tmp_path, change, differs):
    """A resume on another dataset (X scaled by 3, say) continued from the old checkpoints,
    logging only that the model resumes."""
    X, y, Xv, yv = arrays
    _trained(spec, tmp_path, PartitionedDataset.from_arrays(X, y, num_partitions=3, valid=(Xv, yv)))
    X2, y2, Xv2 = change(X, y, Xv)
    other = PartitionedDataset.from_arrays(X2, y2, num_partitions=3, valid=(Xv2, yv))
    with Session(spec, other, executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
        with pytest.raises(ValueError, match=r"checkpoint 'model-0' in .* \(after epoch 2\) was trained on "
                                             rf"other data: {differs}"):
            s.add(CONFIGS[0], epochs=3)
        assert s.history.empty


def test_a_resume_on_the_same_data_goes_on_and_an_old_checkpoint_without_fingerprint_warns(
        spec, data, arrays, tmp_path, caplog):
    import json

    _trained(spec, tmp_path, data)
    meta_file = tmp_path / "model-0" / "epoch-2.json"
    meta = json.loads(meta_file.read_text())
    assert len(meta["data"]) == 3 and all(p["train"]["rows"] == 200 for p in meta["data"])
    X, y, Xv, yv = arrays  # the same data, made again
    with Session(spec, PartitionedDataset.from_arrays(X.copy(), y, num_partitions=3, valid=(Xv, yv)),
                 executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
        s.add(CONFIGS[0], epochs=3)
        assert list(s.run().epoch) == [1, 2, 3]  # 1-2 replayed from the journal, 3 trained
        assert s.scheduler.units_trained == 3
    del meta["data"]  # as written before fingerprints
    meta_file.write_text(json.dumps(meta))
    (tmp_path / "model-0" / "epoch-3.json").unlink()
    with Session(spec, PartitionedDataset.from_arrays(3 * X, y, num_partitions=3, valid=(Xv, yv)),
                 executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
        s.add(CONFIGS[0], epochs=3)
        assert list(s.run().epoch) == [1, 2, 3] and s.scheduler.units_trained == 3
    assert "records no fingerprint of its data" in caplog.text


@pytest.mark.timeout(300)
def test_sigterm_stops_the_driver_as_ctrl_c_does(tmp_path, caplog):
    """SIGTERM (SLURM's wall-time limit, scancel, an eviction) to a driver mid-run: it
    exits within seconds, says how to go on, writes the checkpoints it queued, stops
    its worker processes and releases the directory's lock (no take-over needed, from
    any host). Started again with resume=True it ends with an uninterrupted run's weights."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    here = Path(__file__).parent
    sys.path.insert(0, str(here))
    import session_driver as driver

    env = dict(os.environ, PYTHONPATH=str(here))
    proc = subprocess.Popen([sys.executable, str(here / "session_driver.py"), str(tmp_path)], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
            if len(list((tmp_path / "ckpt").glob("*/epoch-1.json"))) >= 2:
                break
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert workers, "the driver runs its LocalCluster's worker processes"
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        exited_after = time.monotonic() - sent
    finally:
        proc.kill()
    assert not (tmp_path / "weights.pt").exists(), "the driver finished before SIGTERM reached it"
    assert proc.returncode != 0 and exited_after < 30, (proc.returncode, exited_after)
    assert "stopped by SIGTERM" in stderr and "resume=True" in stderr, stderr[-2000:]
    assert not (tmp_path / "ckpt" / ".lock").exists()
    psutil.wait_procs(workers, timeout=30)
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    resumed = driver.run(tmp_path, executor="local")
    assert "taking over the lock" not in caplog.text
    (tmp_path / "fresh").mkdir()
    straight = driver.run(tmp_path / "fresh", executor="local")
    for i in straight:
        assert _same(resumed[i], straight[i])


def test_a_checkpoint_whose_report_was_not_journaled_trains_again_so_the_history_misses_no_epoch(spec, data, tmp_path):
    from cerebro_automl.session.replay import JOURNAL

    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path)) as s:
        s.add(CONFIGS[0], epochs=3, name="a")
        s.add(CONFIGS[1], epochs=3, name="b")
        s.run()
        straight = s.history[["name", "epoch", "val_loss"]]
    journal = tmp_path / "a" / JOURNAL
    journal.write_text("".join(journal.read_text().splitlines(keepends=True)[:2]))  # died before epoch 3's line
    (tmp_path / "b" / JOURNAL).unlink()  # died before b's first line
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
        s.add(CONFIGS[0], epochs=3, name="a")
        s.add(CONFIGS[1], epochs=3, name="b")
        s.run()
        assert s.scheduler.units_trained == 4 * 3  # a's epoch 3 and b's three epochs, on 3 partitions
        assert s.history[["name", "epoch", "val_loss"]].sort_values(["name", "epoch"]).reset_index(drop=True).equals(
            straight.sort_values(["name", "epoch"]).reset_index(drop=True))


def test_a_directory_without_journals_continues_every_model_from_its_checkpoints_and_again(spec, data, tmp_path):
    from cerebro_automl.session.replay import JOURNAL

    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path)) as s:
        s.add(CONFIGS[0], epochs=2, name="a")
        s.add(CONFIGS[1], epochs=2, name="b")
        s.run()
    for journal in tmp_path.glob(f"*/{JOURNAL}"):
        journal.unlink()  # as a run that kept no journal left it
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
        s.add(CONFIGS[0], epochs=3, name="a")
        s.run()  # a journals its epoch 3 before b is added: b still continues from its checkpoint
        s.add(CONFIGS[1], epochs=3, name="b")
        s.run()
        assert sorted(s.history.epoch) == [3, 3] and s.scheduler.units_trained == 2 * 3
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
        s.add(CONFIGS[0], epochs=4, name="a")
        s.run()  # resumed again: after epoch 3, which its journal holds, replayed
        assert list(s.history.epoch) == [3, 4] and s.scheduler.units_trained == 3


def test_the_reports_journal_survives_a_line_cut_short_and_a_resume_counts_only_what_trains(spec, data, tmp_path):
    from cerebro_automl.session.replay import JOURNAL, Replay

    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path)) as s:
        s.add(CONFIGS[0], epochs=2, name="m")
        s.run()
    journal = tmp_path / "m" / JOURNAL
    assert [json.loads(line)["epoch"] for line in journal.read_text().splitlines()] == [1, 2]  # one line each
    journal.write_text(journal.read_text() + '{"epoch": 3, "metr')  # a kill mid-write
    Replay(tmp_path).record("m", 9, {"val_loss": 0.5}, (0, 1))
    assert sorted(Replay(tmp_path).reports("m")) == [1, 2, 9]
    assert journal.read_text().splitlines()[2:] == ['{"epoch": 3, "metr', journal.read_text().splitlines()[-1]]
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path), resume=True) as s:
        s.add(CONFIGS[0], epochs=1, name="m")
        s.run()
        assert s.scheduler.units_trained == 0
        s.extend(0, 2)  # epoch 2 comes from its checkpoint; epoch 3 trains
        s.run()
        assert s.scheduler.units_trained == partition_count(s.data)
        assert s._bar.total == s.scheduler.units_trained  # the bar counts what trains


@pytest.mark.parametrize("first, then", [("fixed", "cyclic"), ("cyclic", "fixed")])
def test_a_checkpoint_continues_only_in_its_own_latin_order(tmp_path, first, then):
    """Fixed and cyclic order visit other partitions past epoch 1, hence give other
    bits: a checkpoint written in one is refused by a resume in the other, and a
    cyclic run's history says so."""
    ckpt = str(tmp_path / "ckpt")
    with Session(make_spec(), _data_for_resume(), seed=3, order=first, executor="local",
                 checkpoint_dir=ckpt) as s:
        s.add(CONFIGS[0], epochs=2)
        for _ in s.reports():
            pass
        assert ("cyclic" in s.history) == (first == "cyclic")
    with pytest.raises(ValueError, match=r"was written by another run .*'cyclic'"):
        with Session(make_spec(), _data_for_resume(), seed=3, order=then, executor="local",
                     checkpoint_dir=ckpt, resume=True) as s:
            s.add(CONFIGS[0], epochs=3)
    with Session(make_spec(), _data_for_resume(), seed=3, order=first, executor="local",
                 checkpoint_dir=ckpt, resume=True) as s:  # its own order continues after epoch 2
        s.add(CONFIGS[0], epochs=3)
        for _ in s.reports():
            pass
        assert list(s.history.epoch) == [1, 2, 3]  # two reports replayed, one trained


def test_a_resume_from_a_checkpoint_dir_that_does_not_exist_says_so(spec, data, tmp_path, caplog):
    """A mistyped path trained everything again without a word."""
    typo = tmp_path / "checkpionts"
    with caplog.at_level(logging.WARNING, logger="cerebro_automl"), \
            Session(spec, data, executor="local", checkpoint_dir=str(typo), resume=True) as s:
        s.add(CONFIGS[0], epochs=1)
        s.run()
    assert f"resume=True, but checkpoint_dir {typo} did not exist (created now): nothing to resume" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cerebro_automl"), \
            Session(spec, data, executor="local", checkpoint_dir=str(typo), resume=True) as s:
        s.add(CONFIGS[0], epochs=1)
        s.run()
    assert "did not exist" not in caplog.text  # it does now, and holds the model
