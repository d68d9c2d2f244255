"""Each worker's clock, with the slowest of them kept up to date as they move: `rules.slowest` in O(1) per push.

A pull asks for the slowest clock (SSP's bound, the clock gap it reports) and a push moves one
clock by one. Scanning every worker's clock for each pull costs O(N) per gradient, which is what a
simulated cluster of a thousand workers spends its time on (psgd/sim/, `psgd bench sim`).

`Clocks` is the policy's list of clocks (a `list`: read, compared and saved as before) that keeps
an index beside it: how many live workers stand at each clock (clock + offset, psgd/core/roster.py)
and the lowest of those clocks. A live worker's clock moving up by one moves the counts in O(1),
and the minimum moves up by one when the last worker at it has left it (it now stands one above,
and nobody live is below). Anything else (a joiner's clock set, a checkpoint's clocks restored, a
gone worker's clock, another list operation) drops the index, and so does a change of who is gone
or of the offsets, seen when `slowest` is asked: the next `slowest` rebuilds it in O(N) by
`rules.slowest`'s definition. Those are membership events, rare beside pushes. (A push between a
membership change and the next `slowest` may move the index by the old membership: harmless, as
that `slowest` sees the change and rebuilds.)

`slowest(gone, offset, epoch)` always equals `rules.slowest(self, gone, offset)` (tests/test_clocks.py
checks it after every step of random runs). `epoch` is the roster's count of in-place offset changes
(an offset list that is replaced is seen by its identity). No lock of its own: the policy's lock
guards it, as it guards the list. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from psgd.core import rules


class Clocks(list):
    """The clocks by worker, and the slowest live one (see the module docstring)."""

    def __init__(self, values: Iterable[int] = ()) -> None:
        super().__init__(values)
        self._count: dict[int, int] = {}  # clock + offset -> live workers there
        self._low = 0                     # the lowest key of _count (or rules' all-gone answer)
        self._key: tuple[Any, Sequence[int], int] | None = None  # (gone, offset, epoch) it was built for; None: stale

    def __setitem__(self, i, value) -> None:  # type: ignore[override]
        if isinstance(i, slice) or self._key is None:
            super().__setitem__(i, value)
            self._key = None
            return
        old = list.__getitem__(self, i)
        super().__setitem__(i, value)
        gone, offset, _ = self._key
        if value != old + 1 or i < 0 or i in gone or not self._count:
            self._key = None  # not one live worker's step: rebuild when next asked
            return
        at = old + offset[i]
        left = self._count.get(at, 0) - 1
        if left < 0:  # the offsets moved since the index was built: it is rebuilt when next asked anyway
            self._key = None
            return
        if left:
            self._count[at] = left
        else:
            del self._count[at]
        self._count[at + 1] = self._count.get(at + 1, 0) + 1
        if at == self._low and not left:
            self._low = at + 1  # it was the last at the minimum; everyone live is at or above it now

    def slowest(self, gone: Any, offset: Sequence[int], epoch: int = 0) -> int:
        """`rules.slowest(self, gone, offset)`, from the index (rebuilt first when stale)."""
        key = self._key
        if key is None or key[1] is not offset or key[2] != epoch or key[0] != gone:
            self._rebuild(gone, offset, epoch)
        return self._low

    def _rebuild(self, gone: Any, offset: Sequence[int], epoch: int) -> None:
        count: dict[int, int] = {}
        for w, c in enumerate(self):
            if w not in gone:
                count[c + offset[w]] = count.get(c + offset[w], 0) + 1
        self._count = count
        self._low = min(count) if count else rules.slowest(self, gone, offset)
        self._key = (set(gone), offset, epoch)


def _dropping(name: str):
    method = getattr(list, name)

    def op(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        self._key = None  # the list changed some other way: the index is rebuilt when next asked
        return out
    op.__name__ = name
    return op


for _name in ("__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "remove", "sort",
              "reverse", "clear"):
    setattr(Clocks, _name, _dropping(_name))
