"""A live line while a run trains: tqdm fed by the steps the workers log to OUT/metrics.jsonl.

Contract: `with live(out, total, desc):` shows gradients done of `total`, gradients/s, the time
left, and the largest clock gap seen so far (how far the fastest worker ran ahead of the
slowest: 0 under sync, bounded by s under SSP, unbounded under async), until the block ends.
The launcher only reads the file, so the line never slows the run down; it re-reads the new
complete lines twice a second (a display refresh, not synchronisation). It shows only on a
terminal: with stderr redirected (a log, CI, a test) or `enabled=False` (`psgd run --quiet`)
nothing is drawn, so errors stay one line. `psgd run` and the suite use it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

REFRESH_S = 0.5


@contextlib.contextmanager
def live(out: Path, total: int, desc: str, leave: bool = False, enabled: bool = True) -> Iterator[None]:
    if not enabled or not sys.stderr.isatty():  # a log file or a test gets the result lines only
        yield
        return
    bar = tqdm(total=total, desc=desc, unit="grad", leave=leave, dynamic_ncols=True, file=sys.stderr)
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(out / "metrics.jsonl", bar, stop), daemon=True,
                                name="psgd-progress")
    follower.start()
    try:
        yield
    finally:
        stop.set()
        follower.join()
        bar.close()


def _follow(path: Path, bar: tqdm, stop: threading.Event) -> None:
    offset, gap = 0, 0
    while True:
        stopped = stop.wait(REFRESH_S)  # once stopped, one last read: the line ends on the run's total
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:  # not written yet
            chunk = b""
        cut = chunk.rfind(b"\n") + 1
        offset += cut
        steps = 0
        for line in chunk[:cut].splitlines():
            if b'"event":"step"' in line:
                steps += 1
                gap = max(gap, json.loads(line).get("clock_gap", 0))
        if steps:
            bar.set_postfix(max_clock_gap=gap, refresh=False)
            bar.update(steps)
        if stopped:
            return
