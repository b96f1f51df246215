"""A reproducible search with gang units, interrupted and resumed, is the search never
interrupted: the same trials, the same per-epoch metrics and the same gang widths (the
history's ``gang`` column), on a LocalCluster of 4 workers holding 4 partitions, where
the survivors train in gangs of 2 and then 4.

The search is interrupted in this process, by an exception raised from a callback (as
``test_reproducible`` kills its driver at a tell), so the 4 workers serve every run:
the study is left with RUNNING trials, and the checkpoint directory with checkpoints
and the reports journal, as a dead driver leaves them.

Two ways of resuming:

* Optuna resumes in the middle of the canonical order, at the last logical time the
  study's journal says was handled: an epoch whose width the dead driver had decided
  must keep it, though the trials live at the resume may be fewer than those live
  when it was decided (the journal's ``cerebro_widths``).
* ASHA and successive halving are run again with the same call and ``resume=True``:
  the session replays the journaled reports, with the widths their epochs were trained
  at; successive halving gives each rung's widths again, from its plan.
"""

from __future__ import annotations

import optuna
import pytest

from models import make_spec

pytestmark = pytest.mark.cluster

N_TRIALS, EPOCHS, PARALLELISM = 5, 4, 2


class Interrupted(BaseException):
    """Raised from a callback: the search stops there (not an Exception, which a
    session's callback list would log and swallow)."""


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 3e-1, log=True), "width": 8, "dropout": 0.0}


def optuna_search(client, data, folder, study=None, interrupt_at=None):
    """The search in ``folder``, continuing ``study`` if given, interrupted after its
    ``interrupt_at``-th tell; the study, and the session's history (None if interrupted)."""
    from cerebro_automl.adapters.optuna import optimize

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if study is None:
        study = optuna.create_study(pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
    told = []

    def interrupt(study, trial):
        told.append(trial.number)
        if len(told) == interrupt_at:
            raise Interrupted

    try:
        result = optimize(study, make_spec(), data, space, n_trials=N_TRIALS, epochs=EPOCHS, metric="val_loss",
                          parallelism=PARALLELISM, seed=3, reproducible=True, callbacks=[interrupt], client=client,
                          gang=True, checkpoint_dir=str(folder), progress=False)
    except Interrupted:
        return study, None
    return study, result.history


def trials(study):
    return [(t.number, t.state.name, t.params, t.intermediate_values, t.value) for t in study.trials]


def epochs(history):
    """``(name, epoch) -> (val_loss, gang)`` of each epoch the session trained or replayed
    (gang None where the row has none)."""
    return {(n, int(e)): (v, int(g) if g == g else None)
            for n, e, v, g in zip(history.name, history.epoch, history.val_loss, history.gang, strict=True)}


@pytest.fixture(scope="module")
def straight(four, data4, tmp_path_factory):
    study, history = optuna_search(four, data4, tmp_path_factory.mktemp("straight"))
    return trials(study), epochs(history)


# The uninterrupted study: trials 1-3 are pruned after epoch 1, trials 0 and 4 complete;
# trial 0 trains its 4 epochs in gangs of 2, trial 4 its epochs 1-2 in gangs of 2 and
# 3-4 in gangs of 4 (alone by then). Interrupted at the 3rd tell (trial 3 pruned), trial 0
# resumes after epoch 2, and is the only trial live at the resume's first decision; at
# the 4th (trial 0 complete), trial 4 trains again from epoch 0, alone. Widths decided
# again at the resume give those epochs gangs of 4 (see the test after this one).
@pytest.mark.timeout(180)
@pytest.mark.parametrize("interrupt_at", [3, 4])
def test_an_interrupted_optuna_study_with_gang_units_resumes_to_the_same_study(
    four, data4, tmp_path, straight, interrupt_at
):
    whole, whole_epochs = straight
    assert {gang for _, gang in whole_epochs.values()} == {2, 4}  # the widths change as trials end
    study, left = optuna_search(four, data4, tmp_path, interrupt_at=interrupt_at)
    assert left is None and any(t.state == optuna.trial.TrialState.RUNNING for t in study.trials)
    study, history = optuna_search(four, data4, tmp_path, study=study)
    assert trials(study) == whole
    resumed = epochs(history)
    assert resumed and {key: whole_epochs[key] for key in resumed} == resumed


@pytest.mark.timeout(180)
def test_without_the_widths_journal_a_resumed_optuna_study_differs(four, data4, tmp_path, straight, monkeypatch):
    """The check above can fail: widths decided again at the resume, from the trials live
    then, give trial 0's epoch 3 a gang of 4 where it had 2, and another value."""
    from cerebro_automl.adapters.optuna import _OptunaRun

    monkeypatch.setattr(_OptunaRun, "journal_widths", lambda self, given: None)
    whole, whole_epochs = straight
    study, _ = optuna_search(four, data4, tmp_path, interrupt_at=3)
    study, history = optuna_search(four, data4, tmp_path, study=study)
    assert trials(study) != whole
    resumed = epochs(history)
    assert [key for key, (_, gang) in resumed.items() if whole_epochs[key][1] != gang]


def rung_search(client, data, folder, interrupt_after=None, tuner="asha"):
    """ASHA (or successive halving) in ``folder`` (resumed from it if it holds an earlier
    run's checkpoints), interrupted at its ``interrupt_after``-th epoch report; its
    decisions and history (None if interrupted)."""
    from cerebro_automl.adapters.hyperband import asha, successive_halving
    from cerebro_automl.callbacks import Callback

    class InterruptAfter(Callback):
        seen = 0

        def on_epoch_end(self, view, report):
            self.seen += 1
            if self.seen == interrupt_after:
                raise Interrupted

    search = asha if tuner == "asha" else successive_halving
    trials = {"max_trials": 6} if tuner == "asha" else {"n_configs": 6}
    try:
        result = search(make_spec(), data, lambda rng: {"lr": float(10 ** rng.uniform(-3, -1)), "width": 8,
                                                        "dropout": 0.0},
                        min_epochs=1, max_epochs=4, eta=2, metric="val_loss", reproducible=True, client=client,
                        gang=True, checkpoint_dir=str(folder), resume=True, seed=1, progress=False,
                        session_callbacks=[InterruptAfter()], **trials)  # fmt: skip
    except Interrupted:
        return None, None
    decisions = [(d.rung, d.epochs, sorted(d.values.items()), d.promoted) for d in result.decisions]
    return decisions, epochs(result.history)


@pytest.fixture(scope="module")
def asha_straight(four, data4, tmp_path_factory):
    return rung_search(four, data4, tmp_path_factory.mktemp("asha_straight"))


# The uninterrupted search trains 11 epochs, the last two (model 1's epochs 3-4) alone in
# gangs of 4. Interrupted after 5 reports (mid rung 0) or 10 (the last is model 1's epoch
# 3, in a gang of 4): the resume replays the journaled reports, each with its width.
# The interrupted session stops its gang units in flight as it closes, so the resume
# finds the cluster's workers free. The timeout is generous for CI's 2 loaded cores.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("interrupt_after", [5, 10])
def test_an_interrupted_asha_search_with_gang_units_resumes_to_the_same_search(
    four, data4, tmp_path, asha_straight, interrupt_after
):
    assert len(asha_straight[1]) == 11 and {gang for _, gang in asha_straight[1].values()} == {1, 4}
    assert rung_search(four, data4, tmp_path, interrupt_after) == (None, None)
    assert rung_search(four, data4, tmp_path) == asha_straight


# Successive halving, rungs of 6, 3 and 1 models to epochs 1, 2 and 4: the lone survivor's
# epochs 3-4 in gangs of 4, decided when its rung starts. Interrupted mid rung 0 (after 5
# reports) or after the survivor's epoch 3 (the 10th report).
@pytest.fixture(scope="module")
def halving_straight(four, data4, tmp_path_factory):
    return rung_search(four, data4, tmp_path_factory.mktemp("halving_straight"), tuner="successive_halving")


@pytest.mark.timeout(300)  # see the ASHA test's comment
@pytest.mark.parametrize("interrupt_after", [5, 10])
def test_an_interrupted_successive_halving_search_with_gang_units_resumes_to_the_same_search(
    four, data4, tmp_path, halving_straight, interrupt_after
):
    assert len(halving_straight[1]) == 11 and {gang for _, gang in halving_straight[1].values()} == {1, 4}
    assert rung_search(four, data4, tmp_path, interrupt_after, tuner="successive_halving") == (None, None)
    assert rung_search(four, data4, tmp_path, tuner="successive_halving") == halving_straight
