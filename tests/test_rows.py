"""psgd/core/rows.py: rows owned by key (hash or range) and the rows a batch touches, deduplicated."""

import numpy as np
import pytest
import torch

from psgd.core import rows
from psgd.core.rows import RowPartition
from psgd.core.sharding import shard_ranges
from psgd.train import clicks


@pytest.mark.parametrize("scheme", rows.SCHEMES)
@pytest.mark.parametrize(("n", "k"), [(10, 3), (1000, 4), (7, 7), (5, 8), (0, 2)])
def test_every_row_has_one_owner_and_a_block_row(scheme, n, k):
    p = RowPartition(n, k, scheme)
    ids = torch.arange(n)
    assert sum(p.share()) == n and len(p.share()) == k
    # Block j of shard s is owned(s)[j]: local and owned are inverse maps.
    for s in range(k):
        mine = p.owned(s)
        assert len(mine) == p.share()[s]
        assert torch.equal(p.local(mine), torch.arange(len(mine)))
        assert torch.equal(p.owner(mine), torch.full_like(mine, s))
    assert torch.equal(torch.sort(torch.cat([p.owned(s) for s in range(k)])).values, ids)


def test_range_holds_contiguous_balanced_ids():
    p = RowPartition(10, 3, "range")
    assert [p.owned(s).tolist() for s in range(3)] == [list(range(lo, hi)) for lo, hi in shard_ranges(10, 3)]
    assert p.share() == [4, 3, 3]


def test_hash_is_knuths_and_spreads_rows_evenly():
    p = RowPartition(100_000, 8, "hash")
    ids = torch.tensor([0, 1, 12345, 99_999])
    want = [((i * 2654435761) % 2**32) * 8 // 2**32 for i in ids.tolist()]
    assert p.owner(ids).tolist() == want
    share = np.array(p.share())
    assert share.min() > 0.97 * share.mean() and share.max() < 1.03 * share.mean()


def test_hot_ids_load_the_first_range_shard_and_spread_under_hash():
    """Zipf ids, id 0 the hottest: range partitioning sends most lookups to shard 0."""
    ids = torch.from_numpy(clicks.draw_ids(np.random.default_rng(0), 10_000, 1.1, 50_000))
    by_range = rows.lookups_per_shard(RowPartition(10_000, 4, "range"), ids)
    by_hash = rows.lookups_per_shard(RowPartition(10_000, 4, "hash"), ids)
    assert sum(by_range) == sum(by_hash) == 50_000
    assert by_range[0] > 0.6 * 50_000                   # the hot head lives on shard 0
    assert max(by_hash) < 0.5 * 50_000                  # hash scatters the head
    assert max(by_hash) / min(by_hash) < max(by_range) / min(by_range)


def test_bad_ids_and_settings_are_refused_in_one_line():
    p = RowPartition(10, 2)
    with pytest.raises(ValueError, match="row id 10 out of range for a table of 10 rows"):
        p.owner(torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="row id -1 out of range"):
        p.local(torch.tensor([-1]))
    with pytest.raises(ValueError, match="must be int64"):
        p.owner(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="scheme must be one of hash, range"):
        RowPartition(10, 2, "modulo")
    with pytest.raises(ValueError, match=">= 1 shard"):
        RowPartition(10, 0)


def test_dedup_gives_sorted_distinct_ids_and_the_map_back():
    ids = torch.tensor([[5, 3, 5], [9, 3, 3]])
    unique, inverse = rows.dedup(ids)
    assert unique.tolist() == [3, 5, 9]
    assert torch.equal(unique[inverse], ids)


def test_sum_rows_adds_each_ids_rows_in_their_order():
    torch.manual_seed(0)
    ids = torch.tensor([4, 1, 4, 4, 2, 1])
    grads = torch.randn(6, 3)
    unique, summed = rows.sum_rows(ids, grads)
    assert unique.tolist() == [1, 2, 4]
    # Bit for bit the sum from zero in the order the rows come.
    for u, s in zip(unique.tolist(), summed, strict=True):
        want = torch.zeros(3)
        for i in torch.nonzero(ids == u).flatten().tolist():
            want = want + grads[i]
        assert torch.equal(s, want)
    with pytest.raises(ValueError, match="sum_rows takes ids"):
        rows.sum_rows(ids, grads[:5])


def test_sum_rows_equals_the_embeddings_dense_gradient():
    """What nn.Embedding's backward gives the table, kept on the touched rows (tolerance: torch's
    dense backward may add a row's contributions in another order; 1e-6 relative here)."""
    torch.manual_seed(1)
    emb = torch.nn.Embedding(50, 4)
    ids = torch.randint(0, 50, (200,))
    emb(ids).pow(2).sum().backward()
    out = 2 * emb.weight.detach()[ids]  # d(sum e^2)/de per lookup
    unique, summed = rows.sum_rows(ids, out)
    assert torch.allclose(emb.weight.grad[unique], summed, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[unique] = False
    assert (emb.weight.grad[untouched] == 0).all()


def test_by_shard_cuts_distinct_ids_into_per_shard_requests():
    p = RowPartition(20, 3, "hash")
    ids = torch.tensor([0, 2, 7, 11, 19])
    parts = rows.by_shard(p, ids)
    assert sorted(torch.cat([pos for pos, _ in parts]).tolist()) == list(range(5))
    for k, (pos, local) in enumerate(parts):
        assert torch.equal(p.owned(k)[local], ids[pos])


def test_wire_bytes_are_the_rows_values_and_their_int64_ids():
    assert rows.wire_bytes(10, 16) == 10 * (16 * 4 + 8)
    assert rows.wire_bytes(10, 16, value_bytes=2) == 10 * (16 * 2 + 8)
