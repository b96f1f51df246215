"""Visit orders: which partition a model trains on at each step of an epoch.

* ``"fixed"`` (Latin order, the default): in epoch ``e`` the model with offset
  ``k`` visits partition ``sigma_e[(k + j) % P]`` at step ``j``; ``sigma_e`` is one
  permutation per epoch shared by all models, drawn from the session seed. What a
  model computes depends only on the seed, its config and its offset, and models
  in lock-step never collide.
* ``"dynamic"``: a model takes any unvisited partition on an idle worker
  (Cerebro's randomized scheduler); the realized order is reported.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ORDERS", "latin_order", "LatinOrders"]

ORDERS = ("fixed", "dynamic")


def latin_order(seed: int, epoch: int, offset: int, num_partitions: int) -> tuple[int, ...]:
    """The partitions a model with ``offset`` visits in ``epoch``, in order (fixed order).

    >>> latin_order(0, 0, 0, 3) == tuple(latin_order(0, 0, 1, 3)[-1:] + latin_order(0, 0, 1, 3)[:-1])
    True
    """
    return _rotate(_sigma(seed, epoch, num_partitions), offset)


def _sigma(seed: int, epoch: int, num_partitions: int) -> tuple[int, ...]:
    """The epoch's permutation of the partitions, shared by all models."""
    return tuple(int(p) for p in np.random.default_rng([seed, epoch]).permutation(num_partitions))


def _rotate(sigma: tuple[int, ...], offset: int) -> tuple[int, ...]:
    """``sigma[(offset + j) % P]`` for j = 0 .. P-1."""
    k = offset % len(sigma)
    return sigma[k:] + sigma[:k]


class LatinOrders:
    """:func:`latin_order` for one session, cached by (offset, epoch)."""

    def __init__(self, seed: int, num_partitions: int) -> None:
        self.seed = seed
        self.num_partitions = num_partitions
        self._orders: dict[tuple[int, int], tuple[int, ...]] = {}
        self._sigmas: dict[int, tuple[int, ...]] = {}

    def of(self, offset: int, epoch: int) -> tuple[int, ...]:
        key = (offset, epoch)
        if key not in self._orders:
            if epoch not in self._sigmas:
                self._sigmas[epoch] = _sigma(self.seed, epoch, self.num_partitions)
            self._orders[key] = _rotate(self._sigmas[epoch], offset)
        return self._orders[key]
