"""Visit orders: which partition a model trains on at each step of an epoch.

* ``"fixed"`` (Latin order, the default): in epoch ``e`` the model with offset
  ``k`` visits partition ``sigma_e[(k + j) % P]`` at step ``j``; ``sigma_e`` is one
  permutation per epoch shared by all models, drawn from the session seed. What a
  model computes depends only on the seed, its config and its offset, and models
  in lock-step never collide. In an epoch trained in gang units of ``w``
  partitions, the permutation is cut into blocks of ``w`` and the model starts at
  block ``lane`` (:func:`gang_order`): models in lock-step on distinct lanes never
  collide either.
* ``"cyclic"``: the same, with one permutation for every epoch (``sigma_0``): a
  model walks one ring of the partitions, epoch after epoch, from its offset. Models
  in different epochs then walk the same ring, where with ``"fixed"`` each epoch's
  permutation is a ring of its own, and a model entering a new epoch meets those
  still in another at random. A tuner that adds and pauses models one at a time
  (ASHA, Optuna with a pruner) keeps models in many epochs at once, so its workers
  idle less: each epoch visits the partitions in the same cyclic order, from
  another start only in gang units.
* ``"dynamic"``: a model takes any unvisited partition on an idle worker
  (Cerebro's randomized scheduler); the realized order is reported.

``"fixed"`` and ``"cyclic"`` (:data:`FIXED_ORDERS`) depend on no timing, so results
are reproducible with either.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ORDERS", "FIXED_ORDERS", "latin_order", "gang_order", "LatinOrders"]

ORDERS = ("fixed", "cyclic", "dynamic")
FIXED_ORDERS = ("fixed", "cyclic")  # a model's visits follow from the seed and its offset, never from timing


def latin_order(seed: int, epoch: int, offset: int, num_partitions: int, *, cyclic: bool = False) -> tuple[int, ...]:
    """The partitions a model with ``offset`` visits in ``epoch``, in order (fixed
    order; ``cyclic``: every epoch as epoch 0).

    >>> latin_order(0, 0, 0, 3) == tuple(latin_order(0, 0, 1, 3)[-1:] + latin_order(0, 0, 1, 3)[:-1])
    True
    >>> latin_order(0, 5, 2, 8, cyclic=True) == latin_order(0, 0, 2, 8)
    True
    """
    return _rotate(_sigma(seed, 0 if cyclic else epoch, num_partitions), offset)


def gang_order(sigma: tuple[int, ...], width: int, lane: int) -> tuple[int, ...]:
    """``sigma`` cut into blocks of ``width`` (``width`` divides its length), the
    blocks visited from block ``lane``.

    >>> gang_order((5, 4, 3, 2, 1, 0), 2, 1)
    (3, 2, 1, 0, 5, 4)
    """
    blocks = [sigma[g : g + width] for g in range(0, len(sigma), width)]
    start = lane % len(blocks)
    return tuple(p for block in blocks[start:] + blocks[:start] for p in block)


def _sigma(seed: int, epoch: int, num_partitions: int) -> tuple[int, ...]:
    """The epoch's permutation of the partitions, shared by all models."""
    return tuple(int(p) for p in np.random.default_rng([seed, epoch]).permutation(num_partitions))


def _rotate(sigma: tuple[int, ...], offset: int) -> tuple[int, ...]:
    """``sigma[(offset + j) % P]`` for j = 0 .. P-1."""
    k = offset % len(sigma)
    return sigma[k:] + sigma[:k]


class LatinOrders:
    """:func:`latin_order` for one session, cached by (offset, epoch); ``cyclic``:
    every epoch's permutation is epoch 0's."""

    def __init__(self, seed: int, num_partitions: int, *, cyclic: bool = False) -> None:
        self.seed = seed
        self.num_partitions = num_partitions
        self.cyclic = cyclic
        self._orders: dict[tuple[int, int], tuple[int, ...]] = {}
        self._sigmas: dict[int, tuple[int, ...]] = {}

    def of(self, offset: int, epoch: int) -> tuple[int, ...]:
        key = (offset, epoch)
        if key not in self._orders:
            self._orders[key] = _rotate(self._sigma(epoch), offset)
        return self._orders[key]

    def of_gang(self, epoch: int, width: int, lane: int) -> tuple[int, ...]:
        """The order of an epoch trained in gang units of ``width`` (:func:`gang_order`)."""
        return gang_order(self._sigma(epoch), width, lane)

    def _sigma(self, epoch: int) -> tuple[int, ...]:
        epoch = 0 if self.cyclic else epoch
        if epoch not in self._sigmas:
            self._sigmas[epoch] = _sigma(self.seed, epoch, self.num_partitions)
        return self._sigmas[epoch]
