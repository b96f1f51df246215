"""Survivors in gang units: how much of a search's tail gang units win back, in the simulator.

    python benchmarks/bench_tail.py [--workers 8 32 128] [--configs 256] [--out benchmarks/results]

The real tuner adapters drive a SimulatedSession (cerebro_automl.simulate.tuners),
as in bench_search_sim.py: the real scheduler in virtual time, P = p partitions,
each configuration's unit cost drawn between 1 and 4 s and its learning curve
drawn from it. Each search runs twice, in plain MOP (``gang=None``) and with gang
units (``gang=GangCost()``: the models left at the end of the search train
data-parallel over k partitions at once, each rank at 1/k of the batch, so
k x steps_per_unit steps per unit, each followed by a ring all-reduce of the
gradients), under the three visit orders ("fixed", the default;
"cyclic", Latin order with one permutation for every epoch; "dynamic", which
``reproducible=True`` cannot use). Per worker count p:

* ASHA over ``--configs`` configurations (eta 3, 1 to 27 epochs);
* Hyperband (max_epochs 27, eta 3): one call of ``hyperband`` runs the 49
  configurations of its plan's four brackets at once; the call is repeated on the
  same session, seeds 0, 1, ..., as many times as brings it nearest ``--configs``
  (5 calls, 245 configurations, for 256);
* Optuna over ``--configs`` trials (TPE with seed 0, SuccessiveHalvingPruner with
  min_resource 1 and reduction factor 3, 27 epochs, parallelism 2p).

All of these with ``reproducible=False``; ASHA and Hyperband once more with
``reproducible=True`` (fixed and cyclic order) at the two largest p; and ASHA in fixed order
with ``parallelism=4p`` where 4p < ``--configs``, and at those p in MOP with every
unit at 2 s (fixed and dynamic order; in tail.json). For each run: the makespan, utilization (the
all-reduces count as busy time; a worker held for a gang whose other workers are
still busy does not), the tail (the time after which the workers are never again
more than half busy, as a share of the makespan), the epochs trained, the widths
the session gave (GangWidth events: one per epoch of a model, counted by width),
and the share of the live models' time spent waiting for a width (in tail.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import optuna

from cerebro_automl.adapters.hyperband import asha, hyperband, hyperband_plan
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.protocol import GangWidth
from cerebro_automl.simulate import GangCost, SimulatedSession

ROOT = Path(__file__).resolve().parents[1]
TUNERS = ("asha", "hyperband", "optuna")
NAMES = {"asha": "ASHA", "hyperband": "Hyperband", "optuna": "Optuna"}
HB_PER_CALL = sum(bracket[0].n for bracket in hyperband_plan(27, 3))  # 49


def sampler(rng):
    return {"lr": float(10 ** rng.uniform(-4, -1)), "width": int(rng.choice([32, 64, 128, 256]))}


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
            "width": trial.suggest_categorical("width", [32, 64, 128, 256])}


def hyperband_calls(configs: int) -> int:
    return max(1, round(configs / HB_PER_CALL))


def run_asha(sim: SimulatedSession, p: int, configs: int, reproducible: bool, parallelism: int | None = None) -> None:
    asha(sim.spec, sim.data, sampler, min_epochs=1, max_epochs=27, eta=3, max_trials=configs,
         metric="val_loss", session=sim, reproducible=reproducible, parallelism=parallelism)


def run_hyperband(sim: SimulatedSession, p: int, configs: int, reproducible: bool) -> None:
    for seed in range(hyperband_calls(configs)):
        hyperband(sim.spec, sim.data, sampler, max_epochs=27, eta=3, seed=seed, metric="val_loss",
                  session=sim, reproducible=reproducible)


def run_optuna(sim: SimulatedSession, p: int, configs: int, reproducible: bool) -> None:
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3))
    optimize(study, sim.spec, sim.data, space, n_trials=configs, epochs=27, metric="val_loss", session=sim,
             reproducible=reproducible, parallelism=2 * p)


RUN = {"asha": run_asha, "hyperband": run_hyperband, "optuna": run_optuna}


def measure(tuner: str, p: int, configs: int, gang: bool, order: str, reproducible: bool = False,
            parallelism: int | None = None, unit_cost: float | None = None) -> dict:
    started = time.perf_counter()
    sim = SimulatedSession(workers=p, seed=0, gang=GangCost() if gang else None, order=order,
                           unit_cost=None if unit_cost is None else lambda config: unit_cost)
    widths: Counter[int] = Counter()
    handle = sim._sim.handle

    def recording(event):
        if isinstance(event, GangWidth):
            widths[event.width] += 1
        return handle(event)

    sim._sim.handle = recording
    # model-seconds live, and of them waiting for a width: the state before each step
    # holds until the clock moves (the tuner's decisions at an instant come before it)
    waited = [0.0, 0.0]
    step, engine = sim._sim.step, sim._sim.s

    def stepping():
        wanting, live, now = len(engine.widths_wanted()), len(engine.live_models()), sim.now
        step()
        waited[0] += wanting * (sim.now - now)
        waited[1] += live * (sim.now - now)

    sim._sim.step = stepping
    RUN[tuner](sim, p, configs, reproducible, **({} if parallelism is None else {"parallelism": parallelism}))
    timeline = sim.timeline(bins=10)
    return {"utilization": timeline.utilization_total, "makespan_s": sim.now, "tail_share": timeline.tail_share,
            "tail_idle_share": timeline.tail_idle_share, "epochs": len(sim.history),
            "models": len(sim._configs), "widths": {str(k): widths[k] for k in sorted(widths)},
            "waiting_for_width": waited[0] / waited[1] if waited[1] else 0.0,
            "timeline": timeline.utilization, "wall_s": time.perf_counter() - started}


def pair(tuner: str, p: int, configs: int, order: str, reproducible: bool = False,
         parallelism: int | None = None) -> dict:
    out = {}
    for key, gang in (("mop", False), ("dp", True)):
        out[key] = measure(tuner, p, configs, gang, order, reproducible, parallelism)
        print(f"{tuner} p={p} {order}{' reproducible' if reproducible else ''}"
              f"{f' parallelism {parallelism}' if parallelism else ''} {key}: "
              f"makespan {out[key]['makespan_s']:.0f} s, utilization {out[key]['utilization']:.3f}, "
              f"widths {out[key]['widths']} ({out[key]['wall_s']:.1f} s)", flush=True)
    return out


def ratio(r: dict) -> float:
    return r["dp"]["makespan_s"] / r["mop"]["makespan_s"]


def span(values, fmt: str = ".2f") -> str:
    values = list(values)
    lo, hi = f"{min(values):{fmt}}", f"{max(values):{fmt}}"
    return lo if lo == hi else f"{lo}-{hi}"


def and_(items) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def row(tuner: str, p: int, order: str, r: dict) -> str:
    mop, dp = r["mop"], r["dp"]
    widths = ", ".join(f"{w}: {n}" for w, n in dp["widths"].items())
    return (f"| {tuner} | {p} | {order} | {mop['makespan_s']:,.0f} / {dp['makespan_s']:,.0f} s | "
            f"{ratio(r):.2f}x | {mop['utilization']:.2f} / {dp['utilization']:.2f} | "
            f"{mop['tail_share']:.2f} / {dp['tail_share']:.2f} | {mop['epochs']:,} / {dp['epochs']:,} | {widths} |")


def early(r: dict) -> float:
    """Utilization over the first 40% of the makespan (4 of the timeline's 10 bins),
    while most models train."""
    return sum(r["timeline"][:4]) / 4


def busy_before_the_tail(results: dict) -> list[str]:
    """Fixed order idles workers before the tail too: what the first bins say, and
    what more models at once (ASHA's parallelism 4p) give back."""
    wide = results.get("parallelism_4p", {}).get("asha", {})
    if not wide:
        return []
    ps = list(wide)
    equal = results.get("equal_costs", {}).get("asha", {})
    return [
        "Fixed order idles workers before the tail too: over the first 40% of ASHA's search in MOP, while 2p "
        "models train, fixed order keeps "
        + and_(f"{early(results['asha'][p]['mop']):.2f} (p = {p})" for p in ps)
        + " of the workers busy, dynamic order "
        + and_(f"{early(results['dynamic']['asha'][p]['mop']):.2f}" for p in ps)
        + ": a model waits for the one worker holding its next partition while another model trains there, "
        "and models that ASHA adds one at a time, as others pause, meet there often"
        + (", even at equal speeds (with every unit at 2 s, fixed order keeps "
           + and_(f"{early(equal[p]['fixed']):.2f}" for p in ps) + " busy, dynamic order "
           + and_(f"{early(equal[p]['dynamic']):.2f}" for p in ps) + ")" if equal else "")
        + ". More models "
        "at once give each worker more to choose from: with parallelism 4p, fixed order keeps "
        + and_(f"{early(wide[p]['mop']):.2f}" for p in ps)
        + " busy early on, and the whole search with gangs "
        + and_(f"{wide[p]['dp']['utilization']:.2f} (against {results['asha'][p]['dp']['utilization']:.2f} "
               f"with 2p; makespan {wide[p]['dp']['makespan_s'] / results['asha'][p]['dp']['makespan_s']:.2f}x, "
               f"p = {p})" for p in ps)
        + ", though the search differs (a rung's first promotions come from more models)."
    ]


def cyclic_against_fixed(results: dict, workers: list[int]) -> list[str]:
    """What one permutation for every epoch gives back, with and without reproducible."""
    ps = [str(p) for p in workers]
    util = {order: [block[t][p]["dp"]["utilization"] for t in TUNERS for p in ps]
            for order, block in (("fixed", results), ("cyclic", results["cyclic"]))}
    diffs = [c - f for f, c in zip(util["fixed"], util["cyclic"], strict=True)]
    mid = str(sorted(workers)[-2]) if len(workers) > 1 else ps[0]
    rep, rep_cyclic = results["reproducible"]["asha"], results["reproducible_cyclic"]["asha"]
    early_ps = list(results.get("parallelism_4p", {}).get("asha", {}))
    return [
        "Cyclic order (Latin order with one permutation for every epoch) keeps "
        + (and_(f"{early(results['cyclic']['asha'][p]['mop']):.2f} (p = {p})" for p in early_ps)
           + " of the workers busy over those first 40%" if early_ps else "more workers busy")
        + ": with a permutation of its own for every epoch, a model that enters its next epoch walks another "
        "ring of the partitions than the models still in theirs, and meets them at random; with one for all, "
        "every model walks the same ring. With gangs, cyclic order's utilization is "
        + and_(f"{results['cyclic'][t][mid]['dp']['utilization']:.2f} for {NAMES[t]}" for t in TUNERS)
        + f" at p = {mid} (fixed order: "
        + and_(f"{results[t][mid]['dp']['utilization']:.2f}" for t in TUNERS)
        + f"; dynamic order: " + and_(f"{results['dynamic'][t][mid]['dp']['utilization']:.2f}" for t in TUNERS)
        + "), and over every tuner and p "
        + (f"it is higher than fixed order's by {span(diffs)}" if min(diffs) >= 0
           else f"cyclic minus fixed order's ranges from {min(diffs):+.2f} to {max(diffs):+.2f}")
        + ", though without reproducible=True the two are different searches. With reproducible=True, ASHA's "
        "gangs in cyclic order take "
        + and_(f"{rep_cyclic[p]['dp']['makespan_s'] / rep[p]['dp']['makespan_s']:.2f}x the makespan of fixed "
               f"order at p = {p} (utilization {rep_cyclic[p]['dp']['utilization']:.2f} against "
               f"{rep[p]['dp']['utilization']:.2f})" for p in rep if p in rep_cyclic)
        + (", the same search (the simulator's learning curves do not depend on the order, and the same epochs "
           "are trained)" if all(rep[p]["dp"]["epochs"] == rep_cyclic[p]["dp"]["epochs"] for p in rep_cyclic)
           else "") + ". Its price is in the data's order: every epoch visits the partitions in one "
        "cyclic order (see bench_orders)."
    ]


def commentary(results: dict, workers: list[int]) -> list[str]:
    """What the figures show, computed from them (so that a rerun keeps it true)."""
    lo, hi = str(min(workers)), str(max(workers))
    fixed = [results[t][hi] for t in TUNERS]
    dynamic = [results["dynamic"][t][hi] for t in TUNERS]
    small = [results[t][lo] for t in TUNERS] + [results["dynamic"][t][lo] for t in TUNERS]
    pairs = list(zip(dynamic, fixed, strict=True))
    gains = all(d["dp"]["makespan_s"] < f["dp"]["makespan_s"] for d, f in pairs)
    out = [
        f"Gang units win back most where the tail is longest: at p = {hi}, the makespan with gangs is "
        f"{span(ratio(r) for r in fixed)}x that of MOP with fixed order and {span(ratio(r) for r in dynamic)}x "
        f"with dynamic order, and utilization rises from {span(r['mop']['utilization'] for r in fixed + dynamic)} "
        f"to {span(r['dp']['utilization'] for r in fixed + dynamic)}; at p = {lo}, where the workers idle "
        f"little, it is {span(ratio(r) for r in small)}x.",
        f"{'Dynamic order gains more' if gains else 'Against fixed order'}: at p = {hi} the makespan with gangs "
        "and dynamic order is "
        f"{span(d['dp']['makespan_s'] / f['dp']['makespan_s'] for d, f in pairs)}x that of fixed "
        f"order, whose tail with gangs keeps up to {max(r['dp']['tail_share'] for r in fixed):.2f} of the "
        "makespan: with fixed order each survivor visits its lane's blocks of the epoch's Latin permutation, "
        "and survivors running at different speeds reach blocks that another one holds, so workers idle while "
        "a model waits for the worker holding its next partitions.",
    ]
    slower = [(NAMES[t], p, order, r)
              for order, block in (("fixed", results), ("cyclic", results["cyclic"]), ("dynamic", results["dynamic"]))
              for t in TUNERS for p, r in block[t].items() if ratio(r) > 1]
    if slower:
        out.append(
            "Where gangs take longer ("
            + "; ".join(f"{name} at p = {p}, {order} order: {ratio(r):.2f}x, {r['mop']['epochs']:,} against "
                        f"{r['dp']['epochs']:,} epochs trained, "
                        f"{ratio(r) * r['mop']['epochs'] / r['dp']['epochs']:.2f}x per epoch trained"
                        for name, p, order, r in slower)
            + "), the two runs are different searches: without reproducible=True the tuner decides on reports "
            "as they come, and gang units change when they come.")
    out += busy_before_the_tail(results) + cyclic_against_fixed(results, workers)
    rep = {p: r for p, r in results["reproducible"]["asha"].items() if p in results["asha"]}
    if rep:
        out.append(
            "With reproducible=True the canonical order decides an epoch's width one epoch ahead (at the release "
            "of a model's epoch e, the width of its epoch e + 2), so a survivor trains at most one epoch past its "
            "last released report, then waits for the others: ASHA's live "
            "models spent " + and_(f"{r['dp']['waiting_for_width']:.0%} (p = {p})" for p, r in rep.items())
            + " of their time waiting for a width, and the gangs' makespan is "
            + and_(f"{ratio(r):.2f}x MOP's at p = {p} ({ratio(results['asha'][p]):.2f}x without reproducible)"
                   for p, r in rep.items()) + ".")
    hb = {p: r for p, r in results["reproducible"].get("hyperband", {}).items() if p in results["hyperband"]}
    if hb:
        out.append(
            "Hyperband with reproducible=True decides a rung's widths as it starts, from the plan alone (the "
            "rung's models, beside a rung of as many in each of the call's brackets), and keeps them while the "
            "rung's faster models end; its gangs' makespan is "
            + and_(f"{ratio(r):.2f}x MOP's at p = {p} ({ratio(results['hyperband'][p]):.2f}x without reproducible)"
                   for p, r in hb.items()) + ".")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--configs", type=int, default=256)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--render", action="store_true", help="write tail.md again from --out's tail.json")
    args = parser.parse_args()
    if args.render:
        write(json.loads((Path(args.out) / "tail.json").read_text()), Path(args.out))
        return
    logging.getLogger("cerebro_automl").setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    started = time.perf_counter()
    settings = {
        "gang_cost": dataclasses.asdict(GangCost()), "configs": args.configs,
        "hyperband_calls": hyperband_calls(args.configs),
        "hyperband_configs": hyperband_calls(args.configs) * HB_PER_CALL,
        "workers": args.workers, "partitions": "p", "unit_cost_s": [1.0, 4.0], "reproducible": False,
        "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "cores": os.cpu_count()}
    results: dict = {"settings": settings, "cyclic": {}, "dynamic": {}}
    for tuner in TUNERS:
        results[tuner], results["cyclic"][tuner], results["dynamic"][tuner] = {}, {}, {}
        for p in args.workers:
            results[tuner][str(p)] = pair(tuner, p, args.configs, "fixed")
            results["cyclic"][tuner][str(p)] = pair(tuner, p, args.configs, "cyclic")
            results["dynamic"][tuner][str(p)] = pair(tuner, p, args.configs, "dynamic")
    results["reproducible"], results["reproducible_cyclic"] = (
        {tuner: {str(p): pair(tuner, p, args.configs, order, reproducible=True) for p in sorted(args.workers)[-2:]}
         for tuner in ("asha", "hyperband")} for order in ("fixed", "cyclic"))
    # ASHA with more models at once (where the configurations outnumber them): fixed order's lever
    results["parallelism_4p"] = {"asha": {str(p): pair("asha", p, args.configs, "fixed", parallelism=4 * p)
                                          for p in args.workers if 4 * p < args.configs}}
    # the same searches in MOP with every unit at 2 s: whether fixed order's early idling needs unequal speeds
    results["equal_costs"] = {"asha": {p: {order: measure("asha", int(p), args.configs, False, order, unit_cost=2.0)
                                           for order in ("fixed", "dynamic")}
                                       for p in results["parallelism_4p"]["asha"]}}
    settings["wall_s"] = time.perf_counter() - started

    write(results, Path(args.out))


def write(results: dict, out: Path) -> None:
    """tail.md (the table and what it shows) and tail.json, from ``results``."""
    settings = results["settings"]
    configs, workers = settings["configs"], settings["workers"]
    g = GangCost()
    lines = [
        "# Survivors in gang units: the tail of a search",
        "",
        f"`python benchmarks/bench_tail.py` — {settings['date']}, {settings['cores']} cores, "
        f"{settings['wall_s'] / 60:.0f} min. The real tuners drive a SimulatedSession (the real scheduler in "
        f"virtual time, P = p partitions, unit costs 1-4 s per configuration, modelled learning curves), each "
        f"search in plain MOP and with gang units (`GangCost()`: {g.gradient_bytes / 1e6:.0f} MB of gradients, "
        f"{g.steps_per_unit} steps per unit at the full batch, {g.bandwidth * 8 / 1e9:.0f} Gbit/s, "
        f"{g.latency * 1e6:.0f} µs latency per ring step), under the three visit orders (cyclic: Latin order with one permutation for every epoch). ASHA: {configs} "
        f"configurations, eta 3, 1 to 27 epochs. Hyperband: max_epochs 27, eta 3, called "
        f"{settings['hyperband_calls']} times in turn on one session (seeds 0-{settings['hyperband_calls'] - 1}; "
        f"{HB_PER_CALL} configurations in the four brackets of each call, {settings['hyperband_configs']} in "
        f"all). Optuna: {configs} trials, TPE (seed 0), SuccessiveHalvingPruner (min_resource 1, reduction "
        "factor 3), 27 epochs, parallelism 2p. `reproducible=False` except in the rows marked reproducible "
        "(ASHA and Hyperband, fixed and cyclic order); parallelism 4p: ASHA with twice the models at once. Utilization counts the all-reduces as busy time; tail: the share of the makespan "
        "after which the workers are never again more than half busy; widths: the epochs given each width "
        "with gang units (width: epochs).",
        "",
        "<!-- --8<-- [start:table] -->",
        "| tuner | p | order | makespan MOP / gangs | ratio | utilization MOP / gangs | tail MOP / gangs | "
        "epochs trained MOP / gangs | widths used (gangs) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tuner in TUNERS:
        for p in workers:
            lines.append(row(NAMES[tuner], p, "fixed", results[tuner][str(p)]))
            lines.append(row(NAMES[tuner], p, "cyclic", results["cyclic"][tuner][str(p)]))
            lines.append(row(NAMES[tuner], p, "dynamic", results["dynamic"][tuner][str(p)]))
    for tuner in results["reproducible"]:
        for p, r in results["reproducible"][tuner].items():
            lines.append(row(NAMES[tuner], int(p), "fixed, reproducible", r))
            lines.append(row(NAMES[tuner], int(p), "cyclic, reproducible", results["reproducible_cyclic"][tuner][p]))
    for p, r in results["parallelism_4p"]["asha"].items():
        lines.append(row("ASHA", int(p), "fixed, parallelism 4p", r))
    lines += ["", " ".join(commentary(results, workers)), "<!-- --8<-- [end:table] -->"]
    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tail.md").write_text(table + "\n")
    (out / "tail.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
