"""Forks (Session.add(..., init_from=(model, epoch))) and warm starts (init_state=...):
the new model starts from exactly the given state, with its own config's optimizer
hyperparameters in force, on every executor; a state that does not fit is refused."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, Session

from conftest import cli_cluster, cli_env, make_arrays
from models import make_spec

X, y, Xv, yv = make_arrays(rows=900, valid_rows=150)
PARENT = {"lr": 0.05, "width": 8, "dropout": 0.0}


def _data():
    return PartitionedDataset.from_arrays(X, y, num_partitions=3, valid=(Xv, yv))


def _sgd(config, params):
    return torch.optim.SGD(params, lr=config["lr"], momentum=0.9, weight_decay=config.get("wd", 0.0))


def _step_lr(config, optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


SPEC = make_spec(optimizer_fn=_sgd, scheduler_fn=_step_lr)


def _session(executor, client=None, **kwargs):
    if executor == "local":
        return Session(SPEC, _data(), executor="local", seed=2, **kwargs)
    return Session(SPEC, _data(), client=client, seed=2, **kwargs)


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("executor", ["local", "dask"])
def test_a_fork_starts_from_its_parents_state_with_its_own_hyperparameters(executor, cluster):
    with _session(executor, cluster) as s:
        parent = s.add(PARENT, epochs=2)
        s.run()
        before = s.model(parent).state()
        # lr 0: the fork's first epoch cannot move the weights, so they show its input bit for bit
        frozen = s.add({**PARENT, "lr": 0.0}, epochs=3, init_from=(parent, 2))
        moving = s.add({**PARENT, "lr": 0.02, "wd": 1e-3}, epochs=3, init_from=(parent, 2))
        s.run()
        assert _same(before["model"], s.model(frozen).state()["model"])
        after = s.model(moving).state()
        assert not _same(before["model"], after["model"])
        group = after["optimizer"]["param_groups"][0]
        # the config's lr and weight decay are in force (the parent's StepLR had halved its lr twice:
        # 0.0125), and the fork's own scheduler steps from there, once, at its epoch's end
        assert (group["lr"], group["weight_decay"], group["initial_lr"]) == (0.01, 1e-3, 0.02)
        assert after["scheduler"]["base_lrs"] == [0.02] and after["scheduler"]["last_epoch"] == 3
        assert before["optimizer"]["param_groups"][0]["lr"] == 0.0125
        # the momentum buffers came from the parent (lr 0 moves nothing but updates them)
        assert before["optimizer"]["state"]
        history = s.history.set_index(["model_id", "epoch"])
        assert history.loc[(frozen, 3), "parent"] == parent and history.loc[(frozen, 3), "parent_epoch"] == 2
        assert list(s.history[s.history.model_id == moving].epoch) == [3]


def test_forks_give_the_same_bits_on_any_executor(cluster):
    def run(executor):
        with _session(executor, cluster) as s:
            a = s.add(PARENT, epochs=1)
            b = s.add({**PARENT, "lr": 0.01}, epochs=1)
            s.run()
            c = s.add({**PARENT, "lr": 0.03}, epochs=3, init_from=(b, 1))
            s.extend(a, 2)
            s.run()
            return [s.model(m).state()["model"] for m in (a, b, c)]

    local, dask = run("local"), run("dask")
    assert all(_same(x, y) for x, y in zip(local, dask))


def test_a_warm_start_takes_the_weights_and_the_configs_hyperparameters():
    with _session("local") as s:
        source = s.add(PARENT, epochs=1)
        s.run()
        checkpoint = s.model(source).state()
        frozen = s.add({**PARENT, "lr": 0.0}, epochs=1, init_state=checkpoint)
        weights_only = s.add({**PARENT, "lr": 0.0}, epochs=1, init_state={"model": checkpoint["model"]})
        s.run()
        for m in (frozen, weights_only):
            assert _same(checkpoint["model"], s.model(m).state()["model"])
            assert s.model(m).state()["optimizer"]["param_groups"][0]["initial_lr"] == 0.0
        assert list(s.history[s.history.model_id == frozen].epoch) == [1]
        assert s.history.set_index("model_id").loc[frozen, "warm_start"]


def test_a_warm_start_survives_its_workers_death_from_the_drivers_copy(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 3))
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    with _session("local") as s:
        m = s.add({**PARENT, "lr": 0.0}, epochs=2, init_state=state)
        s.run()
        reference = s.model(m).state()["model"]
    env = cli_env()
    from distributed import Client
    with cli_cluster(tmp_path, [env, env], ("--no-nanny",)) as address, Client(address) as client:
        client.wait_for_workers(2, timeout=60)
        pids = client.run(os.getpid)
        with _session("dask", client) as s:
            m = s.add({**PARENT, "lr": 0.0}, epochs=2, init_state=state)
            holder = s.scheduler.models[m].state_worker
            assert holder in pids
            os.kill(pids[holder], signal.SIGKILL)  # the worker the warm start was sent to
            s.run()
            assert _same(reference, s.model(m).state()["model"]) and _same(state["model"], reference)


@pytest.mark.timeout(240)
def test_a_fork_whose_start_state_dies_with_its_worker_starts_from_the_drivers_copy(tmp_path):
    def run(client=None):
        with _session("local" if client is None else "dask", client) as s:
            parent = s.add(PARENT, epochs=2)
            s.run()
            child = s.add({**PARENT, "lr": 0.01}, epochs=4, init_from=(parent, 2))
            if client is not None:
                holder = s.scheduler.models[child].state_worker
                assert holder is not None  # it starts from the parent's state where it lies
                os.kill(client.run(os.getpid)[holder], signal.SIGKILL)
            s.extend(parent, 2)
            s.run()
            assert [s.status(m) for m in (parent, child)] == ["paused", "paused"]
            return [s.model(m).state()["model"] for m in (parent, child)]

    reference = run()
    env = cli_env()
    from distributed import Client
    with cli_cluster(tmp_path, [env, env, env], ("--no-nanny",)) as address, Client(address) as client:
        client.wait_for_workers(3, timeout=60)
        assert all(_same(a, b) for a, b in zip(reference, run(client)))


def test_states_that_do_not_fit_are_refused_naming_the_keys_and_shapes():
    with _session("local") as s:
        parent = s.add(PARENT, epochs=2)
        s.run()
        with pytest.raises(ValueError, match=r"the state of model 0 after epoch 2 does not fit the model config "
                                             r".* builds: shapes differ: 0.weight \(8, 8\) in the state, "
                                             r"\(16, 8\) in the model"):
            s.add({**PARENT, "width": 16}, epochs=3, init_from=(parent, 2))
        weights = s.model(parent).state()["model"]
        odd = {**{k: v for k, v in weights.items() if k != "3.bias"}, "extra": torch.zeros(1)}
        with pytest.raises(ValueError, match=r"the state of init_state does not fit .*: missing keys "
                                             r"\['3.bias'\]; unexpected keys \['extra'\]"):
            s.add(PARENT, epochs=1, init_state={"model": odd})
        assert len(s.history.model_id.unique()) == 1  # nothing was added


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(init_from=0), TypeError, r"init_from is 0, but must be a tuple \(model_id, epoch\)"),
    (dict(init_from=(7, 1)), ValueError, r"model id 7 is unknown"),
    (dict(init_from=(0, 3)), ValueError, r"init_from is \(0, 3\), but model 0 has reported epochs 1..2"),
    (dict(init_from=(0, 2), epochs=2), ValueError, r"init_from epoch is 2, but must be < epochs=2"),
    (dict(init_from=(0, 2), init_state={"model": {}}), ValueError,
     r"init_from and init_state are given, but a model starts from one state at most"),
    (dict(init_state=[1]), TypeError, r"init_state is a list, but must be a state dict with a 'model' entry"),
])
def test_bad_forks_are_refused_before_anything_is_added(kwargs, error, message):
    kwargs = {"epochs": 3, **kwargs}
    with _session("local") as s:
        s.add(PARENT, epochs=2)
        s.run()
        with pytest.raises(error, match=message):
            s.add(PARENT, **kwargs)


def test_a_stopped_model_cannot_be_forked_and_old_epochs_are_gone():
    with _session("local") as s:
        a = s.add(PARENT, epochs=3)
        b = s.add(PARENT, epochs=1)
        s.run()
        with pytest.raises(ValueError, match=r"init_from is \(0, 1\), but model 0 holds its state only after "
                                             r"epochs \[2, 3\]"):
            s.add(PARENT, epochs=4, init_from=(a, 1))
        s.stop(b)
        with pytest.raises(ValueError, match=r"model 1 is stopped and its state is freed"):
            s.add(PARENT, epochs=4, init_from=(b, 1))


def test_lightning_forks_take_the_new_learning_rate():
    from cerebro_automl.adapters.lightning import LightningSpec

    from lightning_modules import classifier

    spec = LightningSpec(classifier, batch_size=32)
    with Session(spec, _data(), executor="local", seed=0) as s:
        a = s.add({"lr": 0.05, "form": "tuple"}, epochs=1)
        s.run()
        b = s.add({"lr": 0.001, "form": "tuple"}, epochs=2, init_from=(a, 1))
        s.run()
        group = s.model(b).state()["optimizer"]["param_groups"][0]
        assert group["initial_lr"] == 0.001 and group["lr"] == 0.0005  # StepLR(gamma=0.5) from 0.001
