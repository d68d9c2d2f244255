"""Elastic membership schedules: which worker slot is in the run from which update to which.

`psgd run --elastic "0:2,100:4,200:3"` reads: from update 0 two workers train, at update 100 the
run grows to four, at update 200 it shrinks to three. An update is a shard version: a step in
sync, one applied gradient in async / SSP. `parse` turns the text into points and `plan` into one
interval [join, leave) per worker slot, by two rules that keep every slot's story simple:

- growing takes new slots, numbered on from the last one used (a slot that left never comes
  back: a departed worker is refused by the shards, psgd/core/consistency.py);
- shrinking removes the newest slots first (the highest numbers still in), so slot 0, the one
  the others' seeded data order starts from, stays to the end.

So "0:4,100:2,200:4" uses six slots: 0-3 from 0, slots 2 and 3 leave at 100, slots 4 and 5 join
at 200. The number of slots is the shards' capacity (their `num_workers`; with `--elastic` the run's
`--workers` is set to it); the number in at update 0 is the schedule's first point (RunConfig's
`members`). Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One worker slot of a schedule: in the run for updates [join, leave); leave None: to the end."""
    rank: int
    join: int
    leave: int | None


def parse(spec: str) -> tuple[tuple[int, int], ...]:
    """'U:N,U:N,...' -> ((U, N), ...); ValueError with one line naming what is wrong."""
    points: list[tuple[int, int]] = []
    for part in spec.split(","):
        update, sep, count = part.strip().partition(":")
        try:
            u, n = int(update), int(count)
        except ValueError:
            raise ValueError(f"--elastic wants UPDATE:WORKERS,... (e.g. 0:2,100:4,200:3), got {part.strip()!r}") \
                from None
        if not sep:
            raise ValueError(f"--elastic wants UPDATE:WORKERS,... (e.g. 0:2,100:4,200:3), got {part.strip()!r}")
        points.append((u, n))
    if points[0][0] != 0:
        raise ValueError(f"--elastic must start at update 0 (0:N, the workers the run starts with), got "
                         f"{points[0][0]}:{points[0][1]}")
    for (u0, _), (u1, _) in zip(points, points[1:], strict=False):
        if u1 <= u0:
            raise ValueError(f"--elastic updates must increase, got {u0} then {u1}")
    for u, n in points:
        if n < 1:
            raise ValueError(f"--elastic needs at least one worker at every point, got {u}:{n}")
    return tuple(points)


def plan(points: tuple[tuple[int, int], ...]) -> list[Slot]:
    """Every slot's interval (see the module docstring), slots in rank order."""
    join: list[int] = []
    leave: list[int | None] = []
    live: list[int] = []  # ranks in the run, oldest first
    for update, n in points:
        while len(live) > n:
            leave[live.pop()] = update
        while len(live) < n:
            live.append(len(join))
            join.append(update)
            leave.append(None)
    return [Slot(r, join[r], leave[r]) for r in range(len(join))]


def capacity(points: tuple[tuple[int, int], ...]) -> int:
    """The worker slots the shards need for the schedule: every worker that is ever in it."""
    return len(plan(points))


def members_at(slots: list[Slot], update: int) -> list[int]:
    """The ranks in the run at `update`."""
    return [s.rank for s in slots if s.join <= update and (s.leave is None or update < s.leave)]
