"""The policy's `Clocks` (psgd/core/clocks.py) answers `slowest` as `rules.slowest` does, after any move.

Random runs of clock moves, membership changes and offset changes, the index checked against the
definition after every step; then a real SSP policy through pushes, losses, departures and elastic
joins, its roster's answer checked against the definition after every call.
"""

from __future__ import annotations

import random

import pytest
import torch

from psgd.core import rules
from psgd.core.clocks import Clocks
from psgd.core.consistency import make_policy
from psgd.core.outcomes import PolicyError, PullTimeout


@pytest.mark.parametrize("seed", range(20))
def test_clocks_index_equals_the_definition(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    clocks, plain = Clocks([0] * n), [0] * n
    gone: set[int] = set()
    offset = [0] * n
    epoch = 0
    for _ in range(400):
        op = rng.random()
        w = rng.randrange(n)
        if op < 0.7:                               # a push: one clock up by one
            clocks[w] += 1
            plain[w] += 1
        elif op < 0.8:                             # someone leaves or comes back
            gone ^= {w}
        elif op < 0.85:                            # a joiner's clock set, or a checkpoint restored
            v = rng.randrange(10)
            clocks[w], plain[w] = v, v
        elif op < 0.9:                             # an offset changed in place (the roster counts it)
            offset[w] = rng.randrange(-3, 4)
            epoch += 1
        elif op < 0.93:                            # the offsets replaced (a restore)
            offset = [rng.randrange(-3, 4) for _ in range(n)]
        elif op < 0.96:
            values = [rng.randrange(20) for _ in range(n)]
            clocks[:] = values
            plain[:] = values
        # asked now and then only: the index must also follow moves nobody asked about
        if rng.random() < 0.5:
            assert clocks.slowest(set(gone), offset, epoch) == rules.slowest(plain, gone, offset)
    assert clocks == plain and isinstance(clocks, list)


def test_every_worker_gone_gives_the_furthest_clock() -> None:
    clocks = Clocks([3, 5, 4])
    assert clocks.slowest({0, 1, 2}, [0, 0, 0]) == 5
    clocks[1] += 1  # a gone worker's clock (a backup's dropped push): still right
    assert clocks.slowest({0, 1, 2}, [0, 0, 0]) == 6
    assert clocks.slowest({1}, [0, 0, 0]) == 3


def _check(p) -> None:
    assert p.roster.slowest(p.clocks) == rules.slowest(list(p.clocks), p.roster.gone(), p.roster.offset)


@pytest.mark.parametrize("mode", ["ssp", "sync"])
@pytest.mark.parametrize("seed", range(4))
def test_a_policy_under_random_membership_keeps_its_slowest_right(mode: str, seed: int) -> None:
    rng = random.Random(seed)
    n = 6
    p = make_policy(mode, n, apply=lambda g: None, staleness=2, members=4)
    for _ in range(300):
        w = rng.randrange(n)
        op = rng.random()
        try:
            if op < 0.75:
                p.pull(w, p.clocks[w], lambda: None, timeout=0)
                p.push(w, p.clocks[w], p.version, torch.zeros(1))
            elif op < 0.82:
                p.lose(w)
            elif op < 0.88:
                p.depart(w)
            elif op < 0.95:
                p.admit(None, None if rng.random() < 0.5 else p.version + rng.randrange(3))
            else:
                p.cancel(w)
        except (PolicyError, PullTimeout):
            pass  # refused or held: state unchanged, and the answer must still be right
        _check(p)
