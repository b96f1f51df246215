"""PBT's decisions, pure: no Dask, no torch."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

from cerebro_automl.adapters import pbt as pbt_module
from cerebro_automl.adapters.pbt import check_mutations, exploit, next_generation, perturb, rank_population

NAN = math.nan


def test_the_doctests_hold():
    assert doctest.testmod(pbt_module).failed == 0


def test_the_bottom_quantile_copies_the_top_quantile():
    values = {m: float(m) for m in range(8)}  # higher is better: 7 is best
    pairs = exploit(values, 0.25, "max", np.random.default_rng(0))
    assert [loser for loser, _ in pairs] == [0, 1]           # worst first
    assert {parent for _, parent in pairs} <= {6, 7}
    pairs = exploit(values, 0.25, "min", np.random.default_rng(0))
    assert [loser for loser, _ in pairs] == [7, 6] and {p for _, p in pairs} <= {0, 1}


def test_failed_members_are_replaced_and_never_exploited():
    values = {0: 0.9, 1: NAN, 2: 0.5, 3: 0.4, 4: NAN, 5: 0.8}
    for seed in range(20):
        pairs = exploit(values, 0.25, "max", np.random.default_rng(seed))
        losers = [loser for loser, _ in pairs]
        assert set(losers) >= {1, 4}
        assert all(parent in (0, 5) for _, parent in pairs)
        assert not {1, 4} & {parent for _, parent in pairs}


def test_the_quantile_is_at_most_half_and_a_population_of_one_keeps_its_member():
    assert len(exploit({0: 1.0, 1: 2.0, 2: 3.0}, 0.9, "max", np.random.default_rng(0))) == 1
    assert exploit({0: 1.0}, 0.5, "max", np.random.default_rng(0)) == []
    assert exploit({0: NAN, 1: NAN}, 0.5, "max", np.random.default_rng(0)) == []  # no parent to copy


def test_ranking_breaks_ties_by_id_and_puts_nan_last():
    assert rank_population({2: 0.5, 0: 0.5, 1: NAN, 3: 0.1}, "min") == [3, 0, 2, 1]


def test_continuous_values_move_by_a_fifth_within_their_bounds():
    seen = set()
    for seed in range(40):
        new, changes = perturb({"lr": 0.01, "width": 64}, {"lr": (1e-3, 0.011)}, np.random.default_rng(seed))
        assert new["width"] == 64 and set(changes) == {"lr"}
        seen.add(new["lr"])
    assert seen == {0.008, 0.011}  # 0.012 clipped to the upper bound


def test_integers_stay_integers_and_categoricals_move_to_a_neighbour():
    seen = set()
    for seed in range(40):
        new, _ = perturb({"batch": 64, "drop": 0.1}, {"batch": "continuous", "drop": [0.0, 0.1, 0.3]},
                         np.random.default_rng(seed))
        assert isinstance(new["batch"], int) and new["batch"] in (51, 77)
        seen.add(new["drop"])
    assert seen == {0.0, 0.3}
    edge = {perturb({"drop": 0.0}, {"drop": [0.0, 0.1]}, np.random.default_rng(s))[0]["drop"] for s in range(20)}
    assert edge == {0.0, 0.1}  # at the end of the list: stays or moves inward


def test_resampling_and_callable_mutations():
    def sampler(rng):
        return {"lr": 0.5, "opt": "sgd"}

    new, changes = perturb({"lr": 0.01, "opt": "adam"}, {"lr": "continuous", "opt": ["adam", "sgd"]},
                           np.random.default_rng(0), sampler, resample_probability=1.0)
    assert new == {"lr": 0.5, "opt": "sgd"} and changes == {"lr": (0.01, 0.5), "opt": ("adam", "sgd")}
    new, _ = perturb({"layers": 3}, {"layers": lambda v, rng: v + 1}, np.random.default_rng(0))
    assert new == {"layers": 4}


def test_decisions_depend_only_on_the_values_and_the_seed():
    values = {m: (m * 37 % 11) / 10 for m in range(12)}
    configs = {m: {"lr": 0.001 * (m + 1), "drop": [0.0, 0.1, 0.3][m % 3]} for m in range(12)}
    mutations = {"lr": "continuous", "drop": [0.0, 0.1, 0.3]}

    def decide(seed):
        return next_generation(values, configs, quantile=0.25, mode="max", mutations=mutations,
                               rng=np.random.default_rng(seed), sampler=lambda r: configs[0],
                               resample_probability=0.25)

    assert decide(3) == decide(3)
    assert decide(3) != decide(4)
    for fork in decide(3):
        assert fork.config.keys() == configs[fork.parent].keys()


@pytest.mark.parametrize("mutations, message", [
    ({}, r"mutations is \{\}, but must be a non-empty dict"),
    ({"lr": (0.1, 0.01)}, r"mutations\['lr'\] is \(0.1, 0.01\), but bounds must be \(low, high\) with low < high"),
    ({"lr": "log"}, r"mutations\['lr'\] is 'log', but must be 'continuous', \(low, high\), a non-empty list"),
    ({"lr": []}, r"mutations\['lr'\] is \[\], but must be"),
])
def test_bad_mutations_are_named(mutations, message):
    with pytest.raises(ValueError, match=message):
        check_mutations(mutations)


def test_a_mutation_of_a_key_the_config_lacks_is_named():
    with pytest.raises(ValueError, match=r"mutations names 'lr', which config \{'wd': 0.1\} lacks"):
        perturb({"wd": 0.1}, {"lr": "continuous"}, np.random.default_rng(0))
