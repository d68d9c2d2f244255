"""psgd/core/rowclock.py: per-row staleness, and why it is smaller than the global one on Zipf ids."""

import numpy as np
import pytest
import torch

from psgd.core import rows
from psgd.core.rowclock import RowClock
from psgd.train import clicks


def test_a_rows_staleness_counts_the_updates_it_took_between_pull_and_push():
    c = RowClock(10)
    c.pulled(0, torch.tensor([1, 2, 3]))
    c.pulled(1, torch.tensor([2, 3, 4]))
    assert c.applied(1, torch.tensor([2, 3, 4])).tolist() == [0, 0, 0]
    # Worker 0 read rows 1-3 before worker 1's push touched 2 and 3.
    assert c.applied(0, torch.tensor([1, 2, 3])).tolist() == [0, 1, 1]
    assert c.updates.tolist() == [0, 1, 2, 2, 1, 0, 0, 0, 0, 0]
    assert c.histogram == {0: 4, 1: 2}
    assert c.mean() == pytest.approx(2 / 6)
    # A push may name a subset of the rows pulled; a new pull replaces the note.
    c.pulled(0, torch.tensor([2, 9]))
    c.pulled(1, torch.tensor([2]))
    c.applied(1, torch.tensor([2]))
    assert c.applied(0, torch.tensor([9])).tolist() == [0]
    assert c.applied(0, torch.tensor([2])).tolist() == [1]


def test_pushing_a_row_not_pulled_is_refused_and_counts_nothing():
    c = RowClock(10)
    with pytest.raises(ValueError, match="never pulled"):
        c.applied(0, torch.tensor([1]))
    c.pulled(0, torch.tensor([1, 5]))
    with pytest.raises(ValueError, match="pushes row 3, which its last pull did not read"):
        c.applied(0, torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="pushes row 7"):
        c.applied(0, torch.tensor([7]))
    with pytest.raises(ValueError, match="distinct and sorted"):
        c.pulled(0, torch.tensor([5, 1]))
    with pytest.raises(ValueError, match="out of range"):
        c.pulled(0, torch.tensor([10]))
    assert c.updates.sum() == 0 and not c.histogram
    c.forget(0)
    with pytest.raises(ValueError, match="never pulled"):
        c.applied(0, torch.tensor([1]))


def test_under_async_round_robin_a_cold_row_is_far_fresher_than_the_global_clock():
    """N workers, each pulls its batch's rows, then pushes in turn (async's steady state): every
    push is N - 1 updates stale globally; per row, only the hot ids are."""
    n_workers, vocab, batch = 8, 5000, 32
    rng = np.random.default_rng(0)
    c = RowClock(vocab)
    pending = {}
    global_stale, version, pulled_at = [], 0, {}
    for step in range(400):
        w = step % n_workers
        if w in pending:  # push what it pulled N updates ago
            c.applied(w, pending[w])
            global_stale.append(version - pulled_at[w])
            version += 1
        ids, _ = rows.dedup(torch.from_numpy(clicks.draw_ids(rng, vocab, 1.1, batch)))
        c.pulled(w, ids)
        pending[w], pulled_at[w] = ids, version
    assert np.mean(global_stale[n_workers:]) == n_workers - 1
    assert max(c.histogram) <= n_workers - 1
    assert c.mean() < 0.35 * (n_workers - 1)
    assert c.histogram[0] > 0.5 * sum(c.histogram.values())
