"""Checkpoint retention (issue 44, point 5): ``keep_checkpoints=k`` keeps each model's k
newest checkpoints, ``keep_best=(metric, mode)`` its best epoch too, and the rest is
removed as the search goes; resume and the best model still work."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, Session
from cerebro_automl.checkpoint import latest_checkpoint, save_checkpoint
from cerebro_automl.retention import Retention

from conftest import make_arrays
from models import make_spec

HERE = Path(__file__).parent
# Learning rates high enough that the metrics go up and down: the best epoch is not the newest.
CONFIGS = [{"lr": 0.3, "width": 16}, {"lr": 1.0, "width": 8}, {"lr": 0.1, "width": 8}]
EPOCHS = 5


def _data():
    X, y, Xv, yv = make_arrays()
    return PartitionedDataset.from_arrays(X, y, num_partitions=3, valid=(Xv, yv))


def _kept(folder: Path) -> dict[str, list[str]]:
    """Each model folder's checkpoint files (the reports journal and lock aside)."""
    return {
        m.name: sorted(p.name for p in m.iterdir() if p.name.startswith("epoch-"))
        for m in sorted(folder.iterdir())
        if m.is_dir()
    }


def _files(epochs) -> list[str]:
    return sorted(f"epoch-{e}.{ext}" for e in epochs for ext in ("json", "pt"))


def _expected(history, model_id: int, k: int, best: tuple[str, str] | None) -> set[int]:
    """The epochs retention keeps of a model: its newest k reported, and its best."""
    rows = history[history.model_id == model_id]
    if "error" in rows:
        rows = rows[rows.error.isna()]
    epochs = sorted(rows.epoch)
    keep = set(epochs[-k:])
    if best is not None:
        metric, mode = best
        values = rows.set_index("epoch")[metric]
        keep.add(int(values.idxmin() if mode == "min" else values.idxmax()))
    return keep


def _weights(session, model_id):
    return session.model(model_id).state()["model"]


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


TRAINED = [0]  # training batches run in this process (the local executor's units)


class Counted(nn.Sequential):
    def forward(self, x):
        if self.training:
            TRAINED[0] += 1
        return super().forward(x)


def counted_model_fn(config):
    return Counted(nn.Linear(8, config["width"]), nn.ReLU(), nn.Dropout(0.1), nn.Linear(config["width"], 3))


def _spec():
    return make_spec(model_fn=counted_model_fn)


def _straight() -> tuple[list[dict], int]:
    """The final weights of CONFIGS trained without a break, and the batches per epoch."""
    TRAINED[0] = 0
    with Session(_spec(), _data(), executor="local") as s:
        ids = [s.add(c, epochs=EPOCHS) for c in CONFIGS]
        s.run()
        weights = [_weights(s, i) for i in ids]
    per_epoch, rest = divmod(TRAINED[0], len(CONFIGS) * EPOCHS)
    assert rest == 0 and per_epoch > 0
    return weights, per_epoch


def _newest(folder: Path) -> dict[int, int]:
    """Each model's newest epoch with a checkpoint record, by model id."""
    return {
        int(m.name.split("-")[1]): max((int(p.stem.split("-")[1]) for p in m.glob("epoch-*.json")), default=0)
        for m in folder.glob("model-*")
    }


# --------------------------------------------------------------- argument checks
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(keep_checkpoints=0), ValueError, r"keep_checkpoints is 0, but must be an int >= 1"),
        (dict(keep_checkpoints=-2), ValueError, r"keep_checkpoints is -2, but must be an int >= 1"),
        (dict(keep_checkpoints=True), ValueError, r"keep_checkpoints is True, but must be an int >= 1"),
        (dict(keep_checkpoints=1.5), ValueError, r"keep_checkpoints is 1.5, but must be an int >= 1"),
        (dict(keep_checkpoints="2"), ValueError, r"keep_checkpoints is '2', but must be an int >= 1"),
        (dict(keep_best=("val_loss", "min")), ValueError, r"keep_best is \('val_loss', 'min'\), but keep_checkpoints is None"),
        (dict(keep_checkpoints=2, keep_best="val_loss"), ValueError, r"keep_best is 'val_loss', but must be \(metric, mode\)"),
        (dict(keep_checkpoints=2, keep_best=("val_loss", "lowest")), ValueError, r"mode 'min' or 'max'"),
        (dict(keep_checkpoints=2, keep_best=("val_los", "min")), ValueError,
         r"keep_best is \('val_los', 'min'\), but the spec's epochs report \['train_loss', 'val_loss', 'val_accuracy'\]"),
        (dict(keep_checkpoints=2, checkpoint_dir=None), ValueError, r"keep_checkpoints is 2, but there is no checkpoint_dir"),
    ],
)
def test_bad_retention_arguments_are_refused_before_any_work(tmp_path, kwargs, error, match):
    """Refused before the directory is created (or locked) and before a cluster starts
    (executor="dask" with no client would start a LocalCluster)."""
    folder = tmp_path / "ckpt"
    kwargs = dict(dict(checkpoint_dir=str(folder)), **kwargs)
    with pytest.raises(error, match=match):
        Session(make_spec(), _data(), executor="dask", **kwargs)
    assert not folder.exists()


def test_keep_best_names_a_metric_the_data_gives(tmp_path):
    """Without validation data an epoch reports train_loss only: a val_ metric is refused."""
    X, y, _, _ = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2)
    with pytest.raises(ValueError, match=r"keep_best is \('val_loss', 'min'\), but the spec's epochs report \['train_loss'\]"):
        Session(make_spec(), data, executor="dask", checkpoint_dir=str(tmp_path / "c"), keep_checkpoints=1,
                keep_best=("val_loss", "min"))
    assert not (tmp_path / "c").exists()
    with Session(make_spec(), data, executor="local", checkpoint_dir=str(tmp_path / "c"), keep_checkpoints=1,
                 keep_best=("train_loss", "min")) as s:
        s.add(CONFIGS[2], epochs=3)
        history = s.run()
    assert _kept(tmp_path / "c") == {"model-0": _files(_expected(history, 0, 1, ("train_loss", "min")))}


# --------------------------------------------------------------- what is kept
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("best", [None, ("val_loss", "min"), ("val_accuracy", "max")])
def test_each_model_keeps_its_newest_k_checkpoints_and_its_best(tmp_path, k, best):
    with Session(make_spec(), _data(), executor="local", checkpoint_dir=str(tmp_path),
                 keep_checkpoints=k, keep_best=best) as s:
        ids = [s.add(c, epochs=EPOCHS) for c in CONFIGS]
        history = s.run()
    kept = _kept(tmp_path)
    apart = 0  # models whose best epoch is not among their newest: the best made a difference
    for i in ids:
        expected = _expected(history, i, k, best)
        assert kept[f"model-{i}"] == _files(expected), (i, expected)
        apart += len(expected) > k
    assert apart >= (1 if best else 0)
    if best is not None:  # each kept record holds its epoch's metrics, as reported
        for i in ids:
            for e in _expected(history, i, k, best):
                meta = json.loads((tmp_path / f"model-{i}" / f"epoch-{e}.json").read_text())
                row = history[(history.model_id == i) & (history.epoch == e)].iloc[0]
                assert meta["metrics"][best[0]] == pytest.approx(row[best[0]], rel=1e-12)


def test_without_keep_checkpoints_every_epoch_stays(tmp_path):
    with Session(make_spec(), _data(), executor="local", checkpoint_dir=str(tmp_path)) as s:
        s.add(CONFIGS[0], epochs=3)
        s.run()
    assert _kept(tmp_path) == {"model-0": _files([1, 2, 3])}
    assert "metrics" not in json.loads((tmp_path / "model-0" / "epoch-3.json").read_text())


class NanAfter(nn.Module):
    """Its outputs turn NaN after ``calls`` training batches (counted in a buffer, which
    travels with the state): the model fails in a known epoch."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.body = nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.limit = calls

    def forward(self, x):
        if self.training:
            self.calls += 1
        out = self.body(x)
        return out * float("nan") if self.calls > self.limit else out


def _nan_model_fn(config):
    return NanAfter(config["nan_after"]) if "nan_after" in config else nn.Sequential(
        nn.Linear(8, config["width"]), nn.ReLU(), nn.Linear(config["width"], 3))


def test_stopped_and_failed_models_keep_their_newest_k(tmp_path):
    """A model the tuner stops keeps its newest k checkpoints (and its best), and so does
    one that fails: its final states may be the ones worth having."""
    batches = 3 * 7  # 600 rows in 3 partitions, batches of 32: 7 per partition
    spec = make_spec(model_fn=_nan_model_fn)
    with Session(spec, _data(), executor="local", checkpoint_dir=str(tmp_path),
                 keep_checkpoints=2, keep_best=("val_loss", "min")) as s:
        stopped = s.add(CONFIGS[0], epochs=6)
        failed = s.add({"lr": 0.01, "nan_after": 4 * batches + 3}, epochs=6)  # fails in epoch 5
        for r in s.reports():
            if getattr(r, "model_id", None) == stopped and getattr(r, "epoch", 0) == 4:
                s.stop(stopped)
        history = s.run()
        assert s.status(stopped) == "stopped" and s.status(failed) == "failed"
    kept = _kept(tmp_path)
    assert kept[f"model-{stopped}"] == _files(_expected(history, stopped, 2, ("val_loss", "min")))
    assert {3, 4} <= _expected(history, stopped, 2, ("val_loss", "min"))
    rows = history[history.model_id == failed]
    assert rows.error.notna().sum() == 1 and rows.epoch.max() == 5  # it failed training epoch 5
    assert kept[f"model-{failed}"] == _files(_expected(history, failed, 2, ("val_loss", "min")))
    assert {3, 4} <= _expected(history, failed, 2, ("val_loss", "min"))


def test_fused_members_keep_their_own_newest_and_best(tmp_path):
    configs = [{"lr": 0.3, "width": 16}, {"lr": 0.5, "width": 16}]
    with Session(make_spec(), _data(), executor="local", checkpoint_dir=str(tmp_path), fuse=2,
                 keep_checkpoints=1, keep_best=("val_accuracy", "max")) as s:
        ids = [s.add(c, epochs=EPOCHS) for c in configs]
        history = s.run()
    assert set(history.get("fuse", [2])) == {2}
    kept = _kept(tmp_path)
    for i in ids:
        assert kept[f"model-{i}"] == _files(_expected(history, i, 1, ("val_accuracy", "max")))


@pytest.mark.timeout(300)
def test_retention_on_the_dask_executor(tmp_path, cluster):
    with Session(make_spec(), _data(), client=cluster, checkpoint_dir=str(tmp_path),
                 keep_checkpoints=2, keep_best=("val_loss", "min")) as s:
        ids = [s.add(c, epochs=EPOCHS) for c in CONFIGS]
        history = s.run()
        assert isinstance(s.best("val_loss", "min").build(), nn.Module)
    kept = _kept(tmp_path)
    for i in ids:
        assert kept[f"model-{i}"] == _files(_expected(history, i, 2, ("val_loss", "min")))
    assert sum(len(_expected(history, i, 2, ("val_loss", "min"))) > 2 for i in ids) >= 1


# --------------------------------------------------------------- resume
def _interrupted(folder: Path, reports: int, **kwargs) -> dict[int, int]:
    """A session closed after ``reports`` epoch reports (as a killed driver would stop);
    each model's newest reported epoch."""
    with Session(_spec(), _data(), executor="local", checkpoint_dir=str(folder), **kwargs) as s:
        ids = [s.add(c, epochs=EPOCHS) for c in CONFIGS]
        for n, _ in enumerate(s.reports(), 1):
            if n == reports:
                break
        history = s.history
    return {i: int(history[history.model_id == i].epoch.max()) if (history.model_id == i).any() else 0 for i in ids}


def _resumed(folder: Path, **kwargs) -> tuple[list[dict], int]:
    """The final weights of the session resumed from ``folder``, and the batches it trained."""
    TRAINED[0] = 0
    with Session(_spec(), _data(), executor="local", checkpoint_dir=str(folder), resume=True, **kwargs) as s:
        ids = [s.add(c, epochs=EPOCHS) for c in CONFIGS]
        s.run()
        return [_weights(s, i) for i in ids], TRAINED[0]


def _check_resumed(newest: dict[int, int], weights: list[dict], trained: int, reported: dict[int, int] | None = None):
    """The bits of a straight run; each model trained again only after its newest
    checkpoint, or its newest reported epoch (which a resume that replays the reports
    continues after; the epoch checkpointed after it is not reported yet)."""
    straight, per_epoch = _straight()
    for i, w in enumerate(straight):
        assert _same(w, weights[i]), i
    assert 0 < max(newest.values()) < EPOCHS  # (no model had finished)
    ids = range(len(CONFIGS))
    reported = reported or {i: max(newest.get(i, 0) - 1, 0) for i in ids}
    least = per_epoch * sum(EPOCHS - newest.get(i, 0) for i in ids)
    most = per_epoch * sum(EPOCHS - min(reported[i], newest.get(i, 0)) for i in ids)
    assert least <= trained <= most < per_epoch * EPOCHS * len(CONFIGS), (least, trained, most)


@pytest.mark.parametrize("k, best", [(1, None), (2, ("val_accuracy", "max"))])
def test_a_resume_after_retention_continues_from_the_newest_and_gives_the_bits_of_a_straight_run(tmp_path, k, best):
    reported = _interrupted(tmp_path, reports=7, keep_checkpoints=k, keep_best=best)
    newest = _newest(tmp_path)
    assert any(newest[i] > reported[i] for i in newest)  # a checkpoint written, its epoch not reported
    for i, r in reported.items():  # the newest reported epoch's checkpoint stays until the next is reported
        assert r == 0 or (tmp_path / f"model-{i}" / f"epoch-{r}.json").exists(), (i, r, _kept(tmp_path))
    assert all(len(files) <= 2 * (k + 2) for files in _kept(tmp_path).values())
    weights, trained = _resumed(tmp_path, keep_checkpoints=k, keep_best=best)
    _check_resumed(newest, weights, trained, reported)
    for m, files in _kept(tmp_path).items():  # after the resume, retention holds as before
        epochs = sorted({int(n.split("-")[1].split(".")[0]) for n in files})
        assert epochs[-1] == EPOCHS and len(epochs) <= k + (best is not None), (m, epochs)


class _FailingRemoval:
    """``remove_checkpoint`` that removes the record, then fails before the state: a
    removal cut short (a crash, a full disk), every ``every``-th call."""

    def __init__(self, every: int) -> None:
        self.calls, self.every = 0, every

    def __call__(self, directory, key, epoch):
        self.calls += 1
        (Path(directory) / key / f"epoch-{epoch}.json").unlink()
        if self.calls % self.every == 0:
            raise OSError(28, "No space left on device")
        (Path(directory) / key / f"epoch-{epoch}.pt").unlink()


def test_a_removal_cut_short_leaves_a_resumable_directory(tmp_path, monkeypatch, caplog):
    """A removal that fails between the record and the state leaves a state file that no
    reader takes for a checkpoint; the run goes on (with a warning), a resume gives the
    bits of a straight run, and the next removal takes the half-removed file away."""
    import cerebro_automl.retention as retention

    failing = _FailingRemoval(every=2)
    monkeypatch.setattr(retention, "remove_checkpoint", failing)
    with caplog.at_level(logging.WARNING, logger="cerebro_automl"):
        reported = _interrupted(tmp_path, reports=8, keep_checkpoints=1)
    assert failing.calls >= 2 and "could not be removed (OSError" in caplog.text
    half = [p for p in tmp_path.glob("model-*/epoch-*.pt") if not p.with_suffix(".json").exists()]
    assert half, "no removal was cut short"
    newest = _newest(tmp_path)
    for m in tmp_path.glob("model-*"):  # what a resume reads: the newest record, whole
        found = latest_checkpoint(tmp_path, m.name)
        assert found is not None and found[1]["epoch"] == newest[int(m.name.split("-")[1])]
    monkeypatch.undo()
    weights, trained = _resumed(tmp_path, keep_checkpoints=1)
    _check_resumed(newest, weights, trained, reported)
    assert _kept(tmp_path) == {f"model-{i}": _files([EPOCHS]) for i in range(len(CONFIGS))}


DRIVER = """
import os, sys
sys.path.insert(0, {here!r})
import cerebro_automl.retention as retention
from test_retention import CONFIGS, EPOCHS, _data, _spec
from cerebro_automl import Session
from pathlib import Path

calls = 0
def remove(directory, key, epoch):  # the driver dies between the record and the state
    global calls
    calls += 1
    (Path(directory) / key / f"epoch-{{epoch}}.json").unlink()
    if calls == {die_at}:
        os._exit(9)
    (Path(directory) / key / f"epoch-{{epoch}}.pt").unlink()
retention.remove_checkpoint = remove
with Session(_spec(), _data(), executor="local", checkpoint_dir={folder!r}, keep_checkpoints=1,
             keep_best=("val_loss", "min")) as s:
    for c in CONFIGS:
        s.add(c, epochs=EPOCHS)
    s.run()
"""


@pytest.mark.timeout(300)
def test_a_driver_killed_mid_removal_leaves_a_directory_that_resumes(tmp_path):
    """A driver process that dies between removing a checkpoint's record and its state:
    the directory resumes (its lock taken over), each model from its newest valid
    checkpoint, with the bits of a straight run; retention then tidies it."""
    code = DRIVER.format(here=str(HERE), die_at=4, folder=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(HERE)),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 9, proc.stderr[-3000:]
    half = [p for p in tmp_path.glob("model-*/epoch-*.pt") if not p.with_suffix(".json").exists()]
    assert len(half) == 1
    newest = _newest(tmp_path)
    weights, trained = _resumed(tmp_path, keep_checkpoints=1, keep_best=("val_loss", "min"))
    _check_resumed(newest, weights, trained)
    assert not [p for p in tmp_path.glob("model-*/epoch-*.pt") if not p.with_suffix(".json").exists()]


# --------------------------------------------------------------- the rule itself
def test_prune_leaves_newer_epochs_alone_and_finishes_half_removals(tmp_path):
    """Epochs newer than the one just written (an earlier run got further) stay; a state
    file whose record is gone is removed; the one just written is always kept."""
    state = {"model": {"w": torch.zeros(2)}}
    for e in range(1, 7):
        save_checkpoint(tmp_path, "m", e, state, {})
    (tmp_path / "m" / "epoch-1.json").unlink()  # a removal cut short
    removed = Retention(1).prune(tmp_path, "m", written=3)
    assert removed == [2, 1]
    assert _kept(tmp_path)["m"] == _files([3, 4, 5, 6])
    assert Retention(2, ("val_loss", "min")).to_keep({1: 0.2, 2: float("nan"), 3: None, 4: 0.9}, written=4) == [1, 3, 4]
    assert Retention(1, ("val_accuracy", "max")).to_keep({1: 0.5, 2: 0.5, 3: 0.1}, written=3) == [1, 3]


# --------------------------------------------------------------- through the tuners
def test_the_tuners_pass_retention_to_their_session(tmp_path):
    """``keep_checkpoints``/``keep_best`` are Session keywords: ASHA and Optuna's
    ``optimize`` take them as they take ``checkpoint_dir``; each trial keeps its newest
    (and its best), and ASHA's result is that of a run keeping everything."""
    import optuna

    from cerebro_automl.adapters.hyperband import asha
    from cerebro_automl.adapters.optuna import optimize

    def sampler(rng):
        return {"lr": float(10 ** rng.uniform(-3, 0)), "width": int(rng.choice([8, 16]))}

    def run(folder, **kwargs):
        return asha(make_spec(), _data(), sampler, min_epochs=1, max_epochs=4, eta=2, max_trials=6, parallelism=2,
                    seed=3, executor="local", checkpoint_dir=str(folder), **kwargs)

    every, kept = run(tmp_path / "all"), run(tmp_path / "kept", keep_checkpoints=1, keep_best=("val_loss", "min"))
    assert (kept.best_config, kept.best_value) == (every.best_config, every.best_value)
    for m, files in _kept(tmp_path / "kept").items():
        mid = int(m.split("-")[1])
        assert files == _files(_expected(kept.history, mid, 1, ("val_loss", "min"))), m
        assert len(_kept(tmp_path / "all")[m]) == len(set(kept.history[kept.history.model_id == mid].epoch)) * 2

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    result = optimize(study, make_spec(), _data(),
                      lambda t: {"lr": t.suggest_float("lr", 1e-3, 1.0, log=True), "width": 8},
                      n_trials=3, epochs=3, metric="val_loss", executor="local",
                      checkpoint_dir=str(tmp_path / "optuna"), keep_checkpoints=1)
    # with no keep_best, a tuner keeps each model's best by its own metric and mode
    for m, files in _kept(tmp_path / "optuna").items():
        mid = result.history[result.history.name == m].model_id.iloc[0]
        assert files == _files(_expected(result.history, mid, 1, ("val_loss", "min"))), m


def test_a_tuner_keeps_each_models_best_by_its_metric_unless_told_otherwise(tmp_path):
    from cerebro_automl.adapters.search import grid_search

    space = {"lr": [1e-2, 0.5, 1.0], "width": [8]}
    kept = grid_search(make_spec(), _data(), space, epochs=EPOCHS, metric="val_accuracy", mode="max",
                       executor="local", checkpoint_dir=str(tmp_path / "best"), keep_checkpoints=1)
    apart = 0
    for m, files in _kept(tmp_path / "best").items():
        expected = _expected(kept.history, int(m.split("-")[1]), 1, ("val_accuracy", "max"))
        assert files == _files(expected), m
        apart += len(expected) > 1
    assert apart >= 1  # a model whose best epoch is not its newest kept it
    newest = grid_search(make_spec(), _data(), space, epochs=EPOCHS, metric="val_accuracy", mode="max",
                         executor="local", checkpoint_dir=str(tmp_path / "loss"), keep_checkpoints=1,
                         keep_best=("val_loss", "min"))  # the caller's choice stands
    for m, files in _kept(tmp_path / "loss").items():
        assert files == _files(_expected(newest.history, int(m.split("-")[1]), 1, ("val_loss", "min"))), m
