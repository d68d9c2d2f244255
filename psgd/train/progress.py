"""A live line while a run trains: tqdm fed by the steps the workers log to OUT/metrics.jsonl.

Contract: `with live(out, total, desc):` shows gradients done of `total`, gradients/s over the
training alone (the bar's clock starts when the first step began, not when the run started: the
start-up is apart, as in summary.json), the time left, and the largest clock gap seen so far (how
far the fastest worker ran ahead of the slowest: 0 under sync, bounded by s under SSP, unbounded
under async), until the block ends. The launcher only reads the file, so the line never slows the
run down; it re-reads the new complete lines twice a second (a display refresh, not
synchronisation). It shows only on a terminal: with stderr redirected (a log, CI, a test) or
`enabled=False` (`psgd run --quiet`) nothing is drawn, so errors stay one line. `psgd run` and the
suite use it.
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


_drawn: list = []  # (bar, desc) of the live line being drawn, if any


def evaluating(k: int, n: int) -> None:
    """The launcher's finish evaluates snapshot k of n (psgd/train/evaluate.py each_snapshot): say
    so on the live line, which otherwise sits at 100% while the run is evaluated."""
    for bar, desc in _drawn:
        bar.set_description_str(f"{desc}: evaluating {k}/{n}")


@contextlib.contextmanager
def live(out: Path, total: int, desc: str, leave: bool = False, enabled: bool = True) -> Iterator[None]:
    if not enabled or not sys.stderr.isatty():  # a log file or a test gets the result lines only
        yield
        return
    bar = tqdm(total=total, desc=desc, unit="grad", leave=leave, dynamic_ncols=True, file=sys.stderr)
    _drawn.append((bar, desc))  # evaluating() writes on it
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(out / "metrics.jsonl", bar, stop), daemon=True,
                                name="psgd-progress")
    follower.start()
    try:
        yield
    finally:
        stop.set()
        follower.join()
        _drawn.remove((bar, desc))
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
                step = json.loads(line)
                if bar.n == 0 and steps == 0:
                    _start_clock(bar, step)
                steps += 1
                gap = max(gap, step.get("clock_gap", 0))
        if steps:
            bar.set_postfix(max_clock_gap=gap, refresh=False)
            bar.update(steps)
        if stopped:
            return


def _start_clock(bar: tqdm, step: dict) -> None:
    """Start the bar's clock when the first step began (its line's time, less the step's own
    seconds), so that gradients/s leaves the start-up out: counted from the bar's creation, a run
    of 1.4 s training after 2.5 s start-up showed a third of its rate. tqdm's clock is time.time,
    the workers' too."""
    if "time" not in step or not hasattr(bar, "start_t"):
        return  # (a line of an older run, or a stand-in bar)
    began = step["time"] - sum(step.get(k, 0.0) for k in ("pull_s", "compute_s", "wait_s", "push_s"))
    bar.start_t = bar.last_print_t = min(began, step["time"])
