import pytest

from psgd.core.sharding import shard_ranges


@pytest.mark.parametrize("n,k", [(0, 1), (1, 3), (10, 3), (12, 4), (1000003, 7), (5, 5)])
def test_ranges_tile_and_balance(n, k):
    ranges = shard_ranges(n, k)
    assert len(ranges) == k
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_bad_arguments():
    with pytest.raises(ValueError):
        shard_ranges(10, 0)
    with pytest.raises(ValueError):
        shard_ranges(-1, 2)
