"""`psgd trace RUN`: a per-worker timeline of one run, where each step's time went.

Contract:
- Input: RUN/metrics.jsonl. Each worker writes one `step` event per step (psgd/train/worker.py:
  rank, clock, compute_s, pull_s, push_s, wait_s, and `time`, the wall clock when the step
  ended) and a `worker_end` event with its `train_start`.
- `segments(step, origin)` rebuilds one step as four segments in loop order, backwards from its
  end: wait, pull (the exchange's `before_compute`: the shard holds the pull, then the
  parameters stream), compute (forward / backward), push (`after_compute`); each ends where the
  next starts and the last ends at the step's `time`. Times are seconds since `origin`, the
  earliest `train_start` of the run (its wall-time origin, as in summary.json; a run without a
  `worker_end`, e.g. a crashed one, falls back to its earliest reconstructed step start).
- This is a RECONSTRUCTION from per-step durations, not a recording of intervals: the loop's
  own overhead between steps shows as a gap before each step; with --overlap the pull and push
  really run during forward / backward (the time forward waited for parameters is counted as
  pull and drawn before compute); with --local-steps the local optimizer step is part of
  compute; in all-reduce mode waiting for the slowest rank is inside the all-reduce, so it is
  drawn as push (a collective cannot tell the two apart), never as wait.
- `--steps A:B` picks clocks A <= clock < B of every worker. The default, 0:30, shows the first
  30 steps: enough to see the pattern (sync: every worker's steps start together and the fast
  ones wait for the slowest; async: nobody waits and the fast workers run ahead, their clocks
  drifting apart; SSP: they drift until the bound holds them), few enough that every step
  stays wider than a few pixels. Start-up is not in it: the start barrier's hold, and the wait
  for the first Init before it, are outside the training time (summary.json's `startup_s`).
- Output: the PNG (default RUN/trace.png) and a CSV beside it (rank, clock, segment, start_s,
  end_s; one row per segment, zero-length ones included), written as every psgd figure is
  (psgd/lab/figure_kit.py `save`). A missing folder, or one without step events, is a one-line
  usage error (exit 2).

    psgd run --mode sync --workers 3 --straggler 2=20 --steps 60 --out results/runs/straggler
    psgd trace results/runs/straggler                  # -> results/runs/straggler/trace.png + .csv
    psgd trace results/runs/straggler --steps 0:61 --out /tmp/all.png
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from psgd.core.errors import Parser, UsageError
from psgd.core.palette import SEGMENT_COLORS
from psgd.lab.figure_kit import plt, save  # figure_kit has chosen the file-only backend (Agg)
from psgd.train.metrics import read_events

KINDS = tuple(SEGMENT_COLORS)  # wait, pull, compute, push: loop order (psgd/train/worker.py), as the palette lists them
DEFAULT_STEPS = (0, 30)
LABEL_EVERY = 5  # a clock number on every 5th step at most: enough to read who is ahead, not a wall of text
AXES_INCHES = 7.0    # about the timeline's width on its 10-inch canvas (the legend takes the rest)
LABEL_POINTS = 7     # the clock labels' font size


@dataclass(frozen=True)
class Segment:
    rank: int
    clock: int
    kind: str       # one of KINDS
    start_s: float  # seconds since the run's training start
    end_s: float


def segments(step: dict, origin: float) -> list[Segment]:
    """One step event -> its four segments in loop order, the last ending at the step's end."""
    end = step["time"] - origin
    out = []
    for kind in reversed(KINDS):
        start = end - step[f"{kind}_s"]
        out.append(Segment(step["rank"], step["clock"], kind, start, end))
        end = start
    return out[::-1]


def parse_steps(text: str) -> tuple[int, int | None]:
    """'A:B' -> (A, B), clocks A <= clock < B; 'A:' runs to the end, ':B' starts at 0."""
    first, sep, last = text.partition(":")
    try:
        a = int(first) if first else 0
        b = int(last) if last else None
    except ValueError:
        a = b = -1
    if not sep or a < 0 or (b is not None and b <= a):
        raise UsageError(f"--steps takes A:B with 0 <= A < B (clocks A..B-1), got {text!r}")
    return a, b


def load(run: Path) -> tuple[list[dict], float, dict]:
    """The run's step events, its time origin and its config (empty when config.json is absent)."""
    metrics = run / "metrics.jsonl"
    if not run.is_dir():
        raise UsageError(f"{run}: no such run folder")
    try:
        events = read_events(metrics)
    except ValueError as e:  # a line that is not JSON: not a psgd metrics file
        raise UsageError(f"{metrics}: not a psgd metrics file ({e})") from None
    steps = [e for e in events if e.get("event") == "step"]
    if not steps:
        raise UsageError(f"{run}: no step events in {metrics.name} (is this a psgd run folder, and did it train?)")
    starts = [e["train_start"] for e in events if e.get("event") == "worker_end"]
    origin = min(starts) if starts else min(s.start_s for e in steps for s in segments(e, 0.0))
    cfg_path = run / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    return steps, origin, cfg


def label_every(starts: dict[int, float], window_s: float) -> int:
    """How many steps apart one row's clock labels stand: the first of 5, 10, 25, 50, 100, 250, ...
    whose labels are a label's width apart on that row (a fast worker's every 5th step overlapped
    where a slow one stretched the window). `starts`: clock -> its compute's start, in seconds."""
    if not starts or window_s <= 0:
        return LABEL_EVERY
    digits = len(str(max(starts)))
    width_s = window_s * (digits + 1) * 0.6 * LABEL_POINTS / 72 / AXES_INCHES   # a digit: about 0.6 em
    every, factors, i = LABEL_EVERY, (2, 2.5, 2), 0   # 5 -> 10 -> 25 -> 50 -> 100 -> 250 ...
    while True:
        at = sorted(t for c, t in starts.items() if c % every == 0)
        if all(b - a >= width_s for a, b in zip(at, at[1:], strict=False)) or every > max(starts):
            return every
        every = int(every * factors[i % 3])
        i += 1


def draw(segs: list[Segment], path: Path, title: str):
    """The timeline: one row per worker (rank 0 on top), segments coloured by kind."""
    ranks = sorted({s.rank for s in segs})
    fig, ax = plt.subplots(figsize=(10.0, 1.2 + 0.55 * len(ranks)))
    totals = {k: sum(s.end_s - s.start_s for s in segs if s.kind == k) for k in KINDS}
    whole = sum(totals.values()) or 1.0
    for kind in KINDS:
        for rank in ranks:
            bars = [(s.start_s, s.end_s - s.start_s) for s in segs if s.rank == rank and s.kind == kind]
            # A thin white edge separates consecutive steps, so single steps stay countable.
            ax.broken_barh(bars, (rank - 0.35, 0.7), facecolors=SEGMENT_COLORS[kind], edgecolor="white",
                           linewidth=0.4, label=f"{kind} ({100 * totals[kind] / whole:.0f}%)" if rank == ranks[0]
                           else None)
    window = max(s.end_s for s in segs) - min(s.start_s for s in segs)
    for rank in ranks:
        starts = {s.clock: s.start_s for s in segs if s.rank == rank and s.kind == "compute"}
        every = label_every(starts, window)
        for clock, start in starts.items():
            if clock % every == 0:
                ax.text(start, rank - 0.38, str(clock), fontsize=LABEL_POINTS, va="bottom", ha="left")
    ax.set_yticks(ranks, [f"worker {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.75)  # rank 0 on top, room for its clock labels
    ax.set_xlabel("seconds since training start (segments reconstructed from each step's durations)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              title="share of the window", title_fontsize=8)
    save(fig, path, ["rank", "clock", "segment", "start_s", "end_s"],
         [[s.rank, s.clock, s.kind, f"{s.start_s:.6f}", f"{s.end_s:.6f}"] for s in segs])
    plt.close(fig)
    return fig


def title(name: str, cfg: dict, shown: str) -> str:
    """`MODE, N workers: steps A-B (FOLDER)`; the folder's name left out where it is the mode's own
    (`results/runs/async`: "async, 4 workers", not "async: async, 4 workers")."""
    if "mode" not in cfg or "workers" not in cfg:
        return f"{name}: {shown}"
    setup = f"{cfg['mode']}, {cfg['workers']} workers: {shown}"
    return setup if name == cfg["mode"] else f"{setup} ({name})"


def main(argv: list[str]) -> int:
    p = Parser(prog="psgd trace", description="Per-worker timeline of one run: wait / pull / compute / push of "
               "every step, from RUN/metrics.jsonl (PNG + CSV).")
    p.add_argument("run", type=Path, help="a run folder (psgd run --out)")
    p.add_argument("--out", type=Path, default=None, help="PNG path, a CSV is written beside (default: RUN/trace.png)")
    p.add_argument("--steps", default=f"{DEFAULT_STEPS[0]}:{DEFAULT_STEPS[1]}", metavar="A:B",
                   help="clocks A..B-1 of every worker (default: %(default)s, the first 30 steps; "
                        "'A:' to the end)")
    a = p.parse_args(argv)
    first, last = parse_steps(a.steps)
    steps, origin, cfg = load(a.run)
    chosen = [e for e in steps if e["clock"] >= first and (last is None or e["clock"] < last)]
    if not chosen:
        clocks = [e["clock"] for e in steps]
        raise UsageError(f"no steps in --steps {a.steps}: {a.run} has clocks {min(clocks)}..{max(clocks)}")
    segs = [s for e in sorted(chosen, key=lambda e: (e["rank"], e["clock"])) for s in segments(e, origin)]
    shown = f"steps {min(e['clock'] for e in chosen)}-{max(e['clock'] for e in chosen)}"
    out = a.out or a.run / "trace.png"
    draw(segs, out, title(a.run.name, cfg, shown))
    print(f"wrote {out} and {out.with_suffix('.csv')}")
    return 0
