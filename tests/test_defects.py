"""Defects found by reading the code (issue 15), each on the in-process executor:
meta-device builds, frozen configs, NaN, checkpoints off the event path,
arguments, thread counts, stale metrics, Lightning's evaluation, Optuna's
refused configs, and a driver that does not spin when nothing can run."""

from __future__ import annotations

import logging
import threading
import time

import optuna
import pytest
import torch
from torch import nn

from cerebro_automl import CheckpointError, ModelFailed, PartitionedDataset, Session, StalledError
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.checkpoint import latest_checkpoint
from cerebro_automl.data import TensorShard
from cerebro_automl.training import UnitError, train_unit

from conftest import make_arrays
from models import CONFIGS, make_spec


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------- 6: meta-device builds
class DropPathNet(nn.Module):
    """Init code that reads a tensor's value, as timm's drop-path schedules do:
    ``.item()`` cannot run on the meta device."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.rate = torch.linspace(0, 0.1, 3)[1].item()
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))

    def forward(self, x):
        return self.net(x)


def test_a_model_fn_that_cannot_run_on_the_meta_device_trains_past_its_first_unit(data):
    spec = make_spec(model_fn=lambda c: DropPathNet(c["width"]))
    with Session(spec, data, executor="local") as s:
        mid = s.add({"lr": 1e-2, "width": 8}, epochs=2)
        s.run()
        assert s.status(mid) == "paused", s.model(mid).error
        built = s.model(mid).build()
        assert _same(built.state_dict(), s.model(mid).state()["model"])


class ShiftedNet(nn.Module):
    """Tensors kept off the state dict as plain attributes, as a constant or a torchmetrics
    metric's states are: a model rebuilt on the meta device would leave them there."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mean = torch.full((8,), 0.5)
        self.scales = [torch.ones(3)]
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))

    def forward(self, x):
        return self.net(x - self.mean) * self.scales[0]


def test_a_model_with_tensors_off_its_state_dict_trains_on_after_its_state_hops(data):
    spec = make_spec(model_fn=lambda c: ShiftedNet(c["width"]))
    with Session(spec, data, executor="local") as s:  # 3 partitions: the state is loaded twice an epoch
        mid = s.add({"lr": 1e-2, "width": 8}, epochs=2)
        s.run()
        assert s.status(mid) == "paused", s.model(mid).error
        assert list(s.history.epoch) == [1, 2]


def test_a_model_fn_that_loads_pretrained_weights_is_checked_without_torch_s_no_op_warnings(data, recwarn):
    pretrained = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).state_dict()

    def from_pretrained(config):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        model.load_state_dict(pretrained)  # a no-op on the meta device, and torch says so per tensor
        return model

    with Session(make_spec(model_fn=from_pretrained), data, executor="local") as s:
        mid = s.add({"lr": 1e-2}, epochs=1)
        s.run()
        assert s.status(mid) == "paused"
    assert not [w for w in recwarn if "non-meta parameter" in str(w.message)]


def test_configs_that_cannot_be_checked_on_the_meta_device_are_said_to_be_unchecked_once(data, caplog):
    def drop_path_net(config):  # fails on the meta device before it reads the config, as from_pretrained
        net = DropPathNet(8)
        net.net = nn.Sequential(nn.Linear(8, config["width"]), nn.ReLU(), nn.Linear(config["width"], 3))
        return net

    with caplog.at_level("WARNING", logger="cerebro_automl"), Session(make_spec(model_fn=drop_path_net), data,
                                                                         executor="local") as s:
        first = s.add({"lr": 1e-2, "width": 8}, epochs=1)
        second = s.add({"lr": 1e-2}, epochs=1)  # lacks width: not refused here, so it fails alone
        s.run()
        assert s.status(first) == "paused" and s.status(second) == "failed"
        assert "KeyError: 'width'" in s.model(second).error
    told = [r.message for r in caplog.records if "are not all checked before training" in r.message]
    assert len(told) == 1 and "drop_path_net" in told[0]
    assert "the model, optimizer or scheduler of {'lr': 0.01, 'width': 8} could not be built" in told[0]


# ------------------------------------------------------------ 7: frozen configs
def test_a_config_mutated_after_add_trains_what_was_added(data):
    spec = make_spec(model_fn=lambda c: nn.Sequential(*[nn.Linear(8, 8) for _ in c["layers"]],
                                                      nn.Linear(8, 3)))
    config = {"lr": 1e-2, "layers": [1, 2]}
    with Session(spec, data, executor="local") as s:
        mid = s.add(config, epochs=1)
        config["layers"].append(3)  # the caller reuses its dict
        config["lr"] = 1.0
        s.run()
        weights = s.model(mid).state()["model"]
        assert s.model(mid).config == {"lr": 1e-2, "layers": [1, 2]}
        assert s.history["config"][0] == {"lr": 1e-2, "layers": [1, 2]}
    with Session(spec, data, executor="local") as s:
        mid = s.add({"lr": 1e-2, "layers": [1, 2]}, epochs=1)
        s.run()
        assert _same(weights, s.model(mid).state()["model"])


def test_configs_handed_out_are_copies(spec, data):
    with Session(spec, data, executor="local") as s:
        mid = s.add({"lr": 1e-2, "width": 8}, epochs=1)
        [report, _] = s.next_reports() + s.next_reports()
        report.config["width"] = 99
        s.model(mid).config["lr"] = 5.0
        assert s.model(mid).config == {"lr": 1e-2, "width": 8}


# --------------------------------------------------------------------- 9: NaN
class EvalNaN(nn.Module):
    """Trains normally; its validation outputs are NaN (a model broken in eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 3)

    def forward(self, x):
        out = self.layer(x)
        return out if self.training else out * float("nan")


def test_best_ignores_models_whose_metric_is_nan(data):
    spec = make_spec(model_fn=lambda c: EvalNaN() if c["width"] == 0 else nn.Linear(8, 3))
    with Session(spec, data, executor="local") as s:
        nan_model = s.add({"lr": 1e-2, "width": 0}, epochs=1)
        others = [s.add({"lr": lr, "width": 8}, epochs=1) for lr in (1e-3, 1e-2)]
        s.run()
        assert s.model(nan_model).metrics["val_loss"] != s.model(nan_model).metrics["val_loss"]
        best = s.best("val_loss")
        assert best.model_id in others
        assert best.metrics["val_loss"] == min(s.model(i).metrics["val_loss"] for i in others)


def test_weights_made_non_finite_by_the_last_optimizer_step_fail_the_unit(caplog):
    # One batch per pass: its loss is finite, and the step after it overflows float32
    # (large inputs make large gradients; lr 1e38 is still a float32).
    X, y, _, _ = make_arrays(rows=16)
    X = X * 1000
    spec = make_spec(model_fn=lambda c: nn.Linear(8, 3), batch_size=64,
                     optimizer_fn=lambda c, params: torch.optim.SGD(params, lr=c["lr"]))
    shard = TensorShard(torch.from_numpy(X), torch.from_numpy(y))
    with pytest.raises(UnitError, match="NonFiniteWeightsError: weight 'weight' is not finite after "
                                        "the pass over partition 0 in epoch 1"):
        train_unit(spec, {"lr": 1e38}, None, shard, seed=0, epoch=0, partition=0, step=0,
                   epoch_end=True, threads=1)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=1, valid=(X, y))
    with Session(spec, data, executor="local") as s:
        bad, good = s.add({"lr": 1e38}, epochs=1), s.add({"lr": 1e-6}, epochs=1)
        reports = list(s.reports())
    failed = [r for r in reports if isinstance(r, ModelFailed)]
    assert [r.model_id for r in failed] == [bad] and "NonFiniteWeightsError" in failed[0].error
    assert s.status(good) == "paused"
    with caplog.at_level(logging.DEBUG, logger="cerebro_automl"), \
            Session(spec, data, executor="local", fuse=2) as s:  # the same, in one fused pass
        bad, good = s.add({"lr": 1e38}, epochs=1), s.add({"lr": 1e-6}, epochs=1)
        reports = list(s.reports())
    assert "models [0, 1] for epochs 0..1" in caplog.text
    failed = [r for r in reports if isinstance(r, ModelFailed)]
    assert [r.model_id for r in failed] == [bad], failed
    assert ("NonFiniteWeightsError: weight 'weight' is not finite after the pass over partition 0 in epoch 1"
            in failed[0].error), failed[0].error
    assert s.status(good) == "paused"


# --------------------------------------------- 10: checkpoints off the event path
def test_checkpoints_are_written_by_a_background_thread_and_flushed(spec, data, tmp_path, monkeypatch):
    import cerebro_automl.session.outcomes as outcomes_module

    writers: list[str] = []
    save = outcomes_module.save_checkpoint

    def slow_save(*args, **kwargs):
        writers.append(threading.current_thread().name)
        time.sleep(0.05)
        return save(*args, **kwargs)

    monkeypatch.setattr(outcomes_module, "save_checkpoint", slow_save)
    with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path)) as s:
        ids = [s.add(c, epochs=2) for c in CONFIGS]
        s.run()  # run() returns once the checkpoints of what it reported are on disk
        for mid in ids:
            state, meta = latest_checkpoint(tmp_path, f"model-{mid}")
            assert meta["epoch"] == 2 and _same(state["model"], s.model(mid).state()["model"])
    assert len(writers) == 2 * len(CONFIGS)
    assert set(writers) == {"cerebro-checkpoints"}


def test_a_checkpoint_that_cannot_be_written_stops_the_run_with_the_reason(spec, data, tmp_path, monkeypatch):
    import cerebro_automl.session.outcomes as outcomes_module

    def full_disk(directory, name, epoch, *args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outcomes_module, "save_checkpoint", full_disk)
    with pytest.raises(CheckpointError, match=r"the checkpoint of model-0 after epoch 1 could not "
                                              r"be written: OSError: \[Errno 28\] No space left"):
        with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path)) as s:
            s.add(CONFIGS[0], epochs=3)
            s.run()


def test_a_failed_checkpoint_write_leaves_no_temporary_file(spec, data, tmp_path):
    """A write that fails (a full disk; here, past the process's file size limit) left
    model-0/.epoch-1.pt.<pid>.tmp behind (issue 34, item 10)."""
    import resource
    import signal

    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a signal that kills
    try:
        with pytest.raises(CheckpointError, match=r"the checkpoint of model-0 after epoch 1 could not be "
                                                  r"written: OSError: \[Errno 27\] File too large"):
            with Session(spec, data, executor="local", checkpoint_dir=str(tmp_path)) as s:
                resource.setrlimit(resource.RLIMIT_FSIZE, (2048, limits[1]))
                s.add({"lr": 1e-2, "width": 64}, epochs=2)
                s.run()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert (tmp_path / "model-0").is_dir()
    assert sorted(p.name for p in (tmp_path / "model-0").iterdir() if p.name != "reports.jsonl") == []


# ------------------------------------------------------------ 12: small defects
def test_a_negative_seed_is_refused_at_init(spec, data):
    with pytest.raises(ValueError, match="seed is -1, but must be an int >= 0"):
        Session(spec, data, seed=-1, executor="local")


def test_the_local_executor_gives_back_torchs_thread_count(spec, data):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with Session(spec, data, executor="local", threads=1) as s:
            s.add(CONFIGS[0], epochs=1)
            s.run()
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_queued_work_of_a_stopped_model_does_not_run_on_the_local_executor(spec, data):
    # Stopping models whose evaluations are queued: those evaluations read a state
    # the stop freed (a KeyError before), and a queued unit would train from scratch.
    with Session(spec, data, executor="local", n_workers=3) as s:
        ids = [s.add(c, epochs=2) for c in CONFIGS]
        stopped = []
        for r in s.reports():
            if not stopped:
                stopped = [m for m in ids if m != r.model_id and s.status(m) == "evaluating"]
                for mid in stopped:
                    s.stop(mid)
        assert stopped and all(s.status(m) == "stopped" for m in stopped)
        assert all(s.executor._models[m].current is None for m in stopped)


class LosesAState(__import__("cerebro_automl").LocalExecutor):
    """Reports once that model 0's newest state is gone, after its first report:
    it trains and is evaluated again, and that evaluation reports nothing new."""

    lost = False

    def poll(self, timeout):
        out = super().poll(timeout)
        if not self.lost and any(type(c.event).__name__ == "EvaluationDone" for c in out):
            from cerebro_automl.executors.base import Completion
            from cerebro_automl.protocol import StatesLost
            self.lost = True
            return out + [Completion(StatesLost(0, newest=True))]
        return out


def test_metrics_of_evaluations_that_report_nothing_are_dropped(spec, data):
    with Session(spec, data, executor=LosesAState()) as s:
        s.add(CONFIGS[0], epochs=1)
        s.run()
        assert s.executor.lost and len(s.history) == 1
        assert s._loop.metrics == {}


def test_a_lightning_evaluation_does_not_write_into_the_state():
    pytest.importorskip("lightning")
    from lightning_modules import CountingValidation

    from cerebro_automl.adapters.lightning import LightningSpec
    from cerebro_automl.training import evaluate_unit

    spec = LightningSpec(lambda c: CountingValidation(), batch_size=32)
    X, y, Xv, yv = make_arrays()
    shard = TensorShard(torch.from_numpy(X), torch.from_numpy(y))
    state = train_unit(spec, {}, None, shard, seed=0, epoch=0, partition=0, step=0,
                       epoch_end=True, threads=1)
    kept = {k: v.clone() for k, v in state["model"].items()}
    evaluate_unit(spec, {}, state, TensorShard(torch.from_numpy(Xv), torch.from_numpy(yv)), seed=0, threads=1)
    assert _same(state["model"], kept)


# -------------------------------------------------- 3: nothing can run, no spin
class NoWorkers(__import__("cerebro_automl").LocalExecutor):
    """A local executor whose only worker is gone after the partitions are placed."""

    def poll(self, timeout):
        out = super().poll(timeout)
        if self._partitions and self._names:
            from cerebro_automl.executors.base import Completion
            from cerebro_automl.protocol import WorkerLost
            self._names, self._instructions = [], type(self._instructions)()
            return out + [Completion(WorkerLost("local-0"))]
        return out


def test_models_waiting_with_no_worker_raise_stalled_error_without_spinning(spec, data):
    import resource

    with Session(spec, data, executor=NoWorkers(), no_worker_timeout=1.5) as s:
        s.add(CONFIGS[0], epochs=1)
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        started = time.monotonic()
        with pytest.raises(StalledError, match=r"no model could run for \d+ s \(no_worker_timeout=1.5\): "
                                               "no worker is alive"):
            s.run()
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        busy = (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime)
        assert 1.5 < wall < 10 and busy < 0.3 * wall, (busy, wall)
        with pytest.raises(StalledError):  # the session stays failed
            s.next_reports()


# ------------------------------------------------- 11: Optuna and refused configs
def test_a_config_refused_by_add_fails_its_trial_and_the_search_goes_on(spec, data):
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def space(trial):  # "narrow" forgets the width that model_fn reads: add refuses it
        kind = trial.suggest_categorical("kind", ["ok", "narrow"])
        return {"lr": 1e-2, "width": 8} if kind == "ok" else {"lr": 1e-2}

    study = optuna.create_study(sampler=optuna.samplers.GridSampler({"kind": ["ok", "narrow"]}))
    seen = []
    optimize(study, spec, data, space, n_trials=2, epochs=1, metric="val_loss", executor="local",
             callbacks=[lambda study, trial: seen.append(trial.state)])
    states = {t.params["kind"]: t.state for t in study.trials}
    assert states == {"ok": optuna.trial.TrialState.COMPLETE, "narrow": optuna.trial.TrialState.FAIL}
    [failed] = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert failed.user_attrs["cerebro_error"].startswith("ValueError: config {'lr': 0.01} lacks key 'width'")
    assert sorted(seen, key=str) == sorted([optuna.trial.TrialState.COMPLETE,
                                            optuna.trial.TrialState.FAIL], key=str)


# ------------------------------------------------------------ 13: Python 3.10
def test_timeouts_are_caught_as_python_310_raises_them():
    """distributed raises asyncio.TimeoutError, which before Python 3.11 is not the
    builtin TimeoutError (seen on 3.10.13 from wait, Future.result and
    wait_for_workers): every handler in the package catches both."""
    import asyncio
    import re
    from pathlib import Path

    import cerebro_automl
    from cerebro_automl.executors.dask import TIMEOUTS

    assert TimeoutError in TIMEOUTS and asyncio.TimeoutError in TIMEOUTS
    root = Path(cerebro_automl.__file__).resolve().parents[1]
    for path in [*(root / "cerebro_automl").rglob("*.py"), *(root / "adapters").rglob("*.py")]:
        assert not re.search(r"except\s*\(?\s*TimeoutError\s*[:),]", path.read_text()), path
