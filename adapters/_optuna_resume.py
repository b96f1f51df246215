"""Resuming an Optuna search whose driver died: the trials it left RUNNING.

Without ``reproducible`` (:meth:`Resuming.resume_plain`): continue each from its
newest checkpoint among the epochs whose values reached the study, or fail it and
enqueue its params again. With it (:meth:`Resuming.resume_in_order`): the journal
a reproducible search keeps in the study (each trial's logical start, each prune
decision, with gang units each epoch's width, the last logical time handled) lets
the resume redo, in canonical order, what the dead driver left half done, so the
study comes out as if it had not died.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cerebro_automl.checkpoint import latest_checkpoint

from .canonical import ReportStream, seed_sampler

__all__ = [
    "Resuming",
    "CONFIG_ATTR",
    "INTERRUPTED_ATTR",
    "ERROR_ATTR",
    "ASKED_ATTR",
    "START_ATTR",
    "PRUNE_ATTR",
    "DONE_ATTR",
    "WIDTHS_ATTR",
]

logger = logging.getLogger("cerebro_automl")

CONFIG_ATTR = "cerebro_config"  # the config the trial trained (JSON)
INTERRUPTED_ATTR = "cerebro_interrupted"  # failed because the driver died, re-enqueued
ERROR_ATTR = "cerebro_error"
# Set right after ask(), before the space is drawn and the model added: a driver
# killed in between leaves a RUNNING trial that a resume knows to be its own.
ASKED_ATTR = "cerebro_asked"
# The journal of a reproducible search, for a resume to redo what a dead driver left
# half done (see the module docstring).
START_ATTR = "cerebro_start"  # trial: [logical time, epoch] it started at
PRUNE_ATTR = "cerebro_prune"  # trial: [logical time, should_prune's answer then]
DONE_ATTR = "cerebro_canonical_done"  # study: the last logical time handled and filled
WIDTHS_ATTR = "cerebro_widths"  # trial, with gang units: [epoch, width, lane] of each epoch decided
STEPS_ATTR = "cerebro_steps_per_epoch"  # study: reports an epoch, what its steps count
REPRODUCIBLE_ATTR = "cerebro_reproducible"  # study: the reproducible setting of the call that ran it last


class Resuming:
    """The resume half of the Optuna adapter's run (``_OptunaRun`` mixes it in): what it
    reads and calls of the run is declared here."""

    optuna: Any
    study: Any
    session: Any
    space: Any
    epochs: int
    seed: int
    callbacks: list
    checkpoint_dir: str | None
    reports: ReportStream
    counted: int
    redo: int | None
    decided: dict[int, bool]
    next_offset: int | None

    # the run's own methods
    log: Callable[[Any, list[dict[str, float]]], None]
    start: Callable[..., None]
    _start_or_fail: Callable[..., None]

    def _checkpoint_to_continue(self, number: int, reported: int) -> tuple[dict, dict] | None:
        """The newest checkpoint (state, meta) of trial ``number`` after at most
        ``reported`` epochs, the last one whose value reached the study, or None. A
        later one is passed over: its epochs' reports were lost, and the pruner must
        see every step, so they are trained again (same bits, same values)."""
        if not self.checkpoint_dir:
            return None
        return latest_checkpoint(self.checkpoint_dir, f"trial-{number}", before=reported + 1)

    def resume_interrupted(self) -> None:
        """Trials left RUNNING by a driver that died: with reproducible, redo what it left
        half done in canonical order (:meth:`resume_in_order`); otherwise continue them, or
        fail and re-enqueue them (:meth:`resume_plain`)."""
        self._check_steps()
        self._check_reproducible()
        if self.reports.reproducible:
            self.resume_in_order()
        else:
            self.resume_plain()

    def _check_steps(self) -> None:
        """The study's steps count what this call's count (epochs, or units with
        ``report_every="unit"``); a study of an earlier call that counted otherwise is
        refused, as its values and logical times would be read wrongly."""
        k = self.reports.steps_per_epoch
        before = self.study.user_attrs.get(STEPS_ATTR, 1 if self.study.get_trials(deepcopy=False) else None)
        if before is None:
            self.study.set_user_attr(STEPS_ATTR, k)
        elif before != k:
            raise ValueError(
                f"the study's steps count {before} report(s) an epoch, but this call makes {k} "
                f"(report_every={self.session.report_every!r}, one report per partition with 'unit'): "
                "continue a study with the report_every and num_partitions it was run with"
            )
        elif STEPS_ATTR not in self.study.user_attrs:
            self.study.set_user_attr(STEPS_ATTR, k)

    def _check_reproducible(self) -> None:
        """Trials left RUNNING are continued by the journal of the setting that ran them
        (canonical order, or checkpoints of the epochs the study heard): a call with the
        other setting is refused while any is left; else the setting is recorded."""
        now = self.reports.reproducible
        before = self.study.user_attrs.get(REPRODUCIBLE_ATTR)
        if before is not None and before != now and self._ours_running():
            raise ValueError(
                f"the study's interrupted trials were run with reproducible={before}, but this call has "
                f"reproducible={now}: continue the study with reproducible={before} (its trials left RUNNING "
                "resume by that setting's journal), then change it"
            )
        if before != now:
            self.study.set_user_attr(REPRODUCIBLE_ATTR, now)

    def _ours_running(self) -> list[Any]:
        """The RUNNING trials this adapter asked (each has a config or the asked mark), in
        trial-number order."""
        TS = self.optuna.trial.TrialState
        return sorted(
            (
                t
                for t in self.study.get_trials(deepcopy=False, states=(TS.RUNNING,))
                if ASKED_ATTR in t.user_attrs or CONFIG_ATTR in t.user_attrs
            ),
            key=lambda t: t.number,
        )

    def resume_plain(self) -> None:
        """Continue each trial left RUNNING from a checkpoint, or fail and re-enqueue it."""
        for frozen in self._ours_running():
            if CONFIG_ATTR not in frozen.user_attrs:  # the driver died before adding its model
                logger.warning(
                    "trial %d was left RUNNING before it started training: failed and re-enqueued", frozen.number
                )
                self._fail_and_enqueue(frozen)
                continue
            trial = self.optuna.trial.Trial(self.study, frozen._trial_id)
            history = frozen.user_attrs.get("cerebro_history", [])
            k = self.reports.steps_per_epoch
            last = self.epochs * k
            if last in frozen.intermediate_values:  # trained to the end; only the tell was lost
                done = self.study.tell(trial, frozen.intermediate_values[last])
                self.log(done, history)
                for callback in self.callbacks:
                    callback(self.study, done)
                continue
            found = self._checkpoint_to_continue(frozen.number, max(frozen.intermediate_values, default=0) // k)
            if found is not None:
                state, meta = found
                self.session.check_checkpoint(
                    f"trial-{frozen.number}",
                    meta,
                    frozen.user_attrs[CONFIG_ATTR],
                    frozen.user_attrs.get("cerebro_offset", meta.get("offset")),
                )
                history = [h for h in history if h["epoch"] <= meta["epoch"]]
                trial.set_user_attr("cerebro_history", history)
                logger.info("trial %d resumes after epoch %d", frozen.number, meta["epoch"])
                self.start(
                    trial,
                    meta["config"],
                    resume=(meta["epoch"], state),
                    offset=meta["offset"],
                    reported=frozen.intermediate_values,
                )
            else:
                logger.warning(
                    "trial %d was left RUNNING, and no checkpoint holds an epoch whose value reached the study: "
                    "failed and re-enqueued",
                    frozen.number,
                )
                self._fail_and_enqueue(frozen)

    def _fail_and_enqueue(self, frozen: Any) -> None:
        """Fail a trial the driver left RUNNING and ask its params again (it is not
        counted twice)."""
        trial = self.optuna.trial.Trial(self.study, frozen._trial_id)
        trial.set_user_attr(INTERRUPTED_ATTR, True)
        self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
        self.counted -= 1
        self.study.enqueue_trial(frozen.params, skip_if_exists=False)

    # ------------------------------------------------------ resume in canonical order
    def resume_in_order(self) -> None:
        """Redo, in canonical order, what a dead driver of this reproducible search left
        undone: continue every trial it left RUNNING at its journaled logical start, after
        the epochs of the times it handled in full, and set up the redo of the next time
        (its journaled prunes, and, if every trial due then was told, its fill alone)."""
        done = self.study.user_attrs.get(DONE_ATTR)  # None: it died in its first fill
        self.redo = None if done is None else done + 1
        step = 0 if done is None else done + 1  # the time trials without a start were asked at
        self.reports.order.now = 0 if done is None else done
        ours = self._ours_running()
        offsets = [
            t.user_attrs["cerebro_offset"]
            for t in self.study.get_trials(deepcopy=False)
            if CONFIG_ATTR in t.user_attrs and "cerebro_offset" in t.user_attrs
        ]
        self.next_offset = max(offsets) + 1 if offsets else None
        self.decided = {
            t.number: bool(t.user_attrs[PRUNE_ATTR][1]) for t in ours if t.user_attrs.get(PRUNE_ATTR, [None])[0] == step
        }
        for frozen in ours:  # in trial order, so model ids follow trial numbers
            trial = self.optuna.trial.Trial(self.study, frozen._trial_id)
            if CONFIG_ATTR in frozen.user_attrs:
                self._continue_in_order(trial, frozen, done, step)
            else:  # asked at ``step``, the driver died before its model was added
                self._start_asked(trial, step)

    def _continue_in_order(self, trial: Any, frozen: Any, done: int | None, step: int) -> None:
        """Continue a trial that was training at its logical start: from its newest
        checkpoint among the epochs of handled times, or else from epoch 0 as the same
        trial (same config and offset, so the same bits); reports of handled times are
        dropped."""
        anchor_time, anchor_epoch = frozen.user_attrs.get(START_ATTR, (step, 0))
        k = self.reports.steps_per_epoch  # logical times count steps: epochs, or units
        released = anchor_epoch * k + (0 if done is None else max(0, done - anchor_time))
        handled = released // k
        if released >= self.epochs * k:
            raise ValueError(
                f"trial {frozen.number} is RUNNING, but its journal says its last epoch ({self.epochs}) was "
                f"handled at logical time {anchor_time + (self.epochs - anchor_epoch) * k} <= {done}; was the "
                "study run without reproducible=True before?"
            )
        history = [h for h in frozen.user_attrs.get("cerebro_history", []) if h["epoch"] <= handled]
        trial.set_user_attr("cerebro_history", history)
        found = self._checkpoint_to_continue(frozen.number, handled)
        config, offset = frozen.user_attrs[CONFIG_ATTR], frozen.user_attrs.get("cerebro_offset")
        # The gang widths the dead driver decided: the epochs trained again, and those
        # decided ahead, keep them (the trials live now need not be those live then).
        widths = {int(e): (int(width), int(lane)) for e, width, lane in frozen.user_attrs.get(WIDTHS_ATTR, [])}
        resume = None
        if found is not None:
            state, meta = found
            self.session.check_checkpoint(f"trial-{frozen.number}", meta, config, offset)
            config, offset, resume = meta["config"], meta["offset"], (meta["epoch"], state)
        logger.info(
            "trial %d resumes after epoch %d (logical time %d), from epoch %d's checkpoint",
            frozen.number,
            handled,
            anchor_time + released - anchor_epoch * k,
            resume[0] if resume else 0,
        )
        self.start(
            trial,
            config,
            resume=resume,
            offset=offset,
            reported=frozen.intermediate_values,
            history=history,
            released=released,
            anchor=(anchor_time, anchor_epoch),
            widths=widths,
        )

    def _start_asked(self, trial: Any, step: int) -> None:
        """Start a trial asked at logical time ``step`` whose model was never added: its
        space is drawn again (Optuna returns the params it stored, and the sampler is
        seeded as it was for the ask)."""
        seed_sampler(self.study.sampler, self.seed, trial.number)
        try:
            config = dict(self.space(trial))
        except self.optuna.TrialPruned:
            self.study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
            return
        logger.info("trial %d, asked before the driver died, starts at logical time %d", trial.number, step)
        self._start_or_fail(trial, config, anchor=(step, 0))
