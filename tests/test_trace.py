"""`psgd trace`: each step rebuilt from its durations, the timeline's CSV, one-line errors."""

import csv
import json
from pathlib import Path

import pytest

from psgd.core.palette import SEGMENT_COLORS
from psgd.lab import trace
from tests.helpers import psgd_main

pytestmark = pytest.mark.usefixtures("warm_runs")  # its runs fork from the tests' warm parent

START = 1000.0  # train_start of the hand-written runs below (any wall clock will do)


def step(rank: int, clock: int, end: float, compute: float = 0.02, pull: float = 0.003, push: float = 0.002,
         wait: float = 0.0) -> dict:
    return {"event": "step", "rank": rank, "clock": clock, "loss": 2.3, "compute_s": compute, "pull_s": pull,
            "push_s": push, "wait_s": wait, "clock_gap": 0, "time": end}


def write_run(folder: Path, events: list[dict], mode: str = "sync", workers: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (folder / "config.json").write_text(json.dumps({"mode": mode, "workers": workers}))
    return folder


def sync_like(folder: Path, steps: int = 40) -> Path:
    """Two workers in lock step: worker 1 computes 4x longer, worker 0 waits for it every step."""
    events = []
    for clock in range(steps):
        end = START + 0.05 * (clock + 1)
        events += [step(0, clock, end, compute=0.01, wait=0.03), step(1, clock, end + 0.001, compute=0.04)]
    events += [{"event": "worker_end", "rank": r, "steps": steps, "train_start": START, "train_end": end + 0.001}
               for r in (0, 1)]
    return write_run(folder, events)


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_step_is_rebuilt_backwards_from_its_end_in_loop_order():
    e = step(rank=1, clock=7, end=START + 2.5, compute=0.4, pull=0.1, push=0.2, wait=0.3)
    segs = trace.segments(e, origin=START)
    assert [s.kind for s in segs] == ["wait", "pull", "compute", "push"] == list(trace.KINDS)
    assert all(s.rank == 1 and s.clock == 7 for s in segs)
    assert segs[-1].end_s == pytest.approx(2.5)                      # the last part ends when the step did
    for a, b in zip(segs, segs[1:], strict=False):
        assert a.end_s == pytest.approx(b.start_s)                   # back to back, no gap, no overlap
    assert {s.kind: s.end_s - s.start_s for s in segs} == pytest.approx(
        {"wait": 0.3, "pull": 0.1, "compute": 0.4, "push": 0.2})
    assert segs[0].start_s == pytest.approx(2.5 - 1.0)
    assert set(SEGMENT_COLORS) == set(trace.KINDS)


def test_steps_window_parsing():
    assert trace.parse_steps("1:31") == (1, 31)
    assert trace.parse_steps("5:") == (5, None) and trace.parse_steps(":4") == (0, 4)
    for bad in ("5", "3:3", "4:2", "a:b", "-1:3"):
        with pytest.raises(trace.UsageError, match="--steps takes A:B"):
            trace.parse_steps(bad)


def test_trace_writes_the_figure_and_one_csv_row_per_segment(tmp_path):
    run = sync_like(tmp_path / "run")
    r = psgd_main("trace", str(run))
    assert r.returncode == 0, r.stderr
    assert (run / "trace.png").stat().st_size > 0
    table = rows(run / "trace.csv")
    assert list(table[0]) == ["rank", "clock", "segment", "start_s", "end_s"]
    # The default window: clocks 0..29 of every worker, four segments each.
    assert len(table) == 2 * 30 * 4
    assert {int(t["clock"]) for t in table} == set(range(0, 30))
    waits = {int(t["rank"]): float(t["end_s"]) - float(t["start_s"]) for t in table if t["segment"] == "wait"}
    assert waits[0] == pytest.approx(0.03) and waits[1] == 0.0       # the fast worker is the one waiting
    ends = [float(t["end_s"]) for t in table if t["segment"] == "push" and t["rank"] == "0"]
    assert ends == pytest.approx([0.05 * (c + 1) for c in range(0, 30)])  # seconds since train_start

    out = tmp_path / "figs" / "t.png"
    r = psgd_main("trace", str(run), "--steps", "0:3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert out.exists() and len(rows(out.with_suffix(".csv"))) == 2 * 3 * 4


def test_the_figure_names_the_run_and_colours_every_part(tmp_path):
    run = sync_like(tmp_path / "run", steps=5)
    steps, origin, cfg = trace.load(run)
    segs = [s for e in steps for s in trace.segments(e, origin)]
    fig = trace.draw(segs, tmp_path / "t.png", "run: sync, 2 workers")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [label.split()[0] for label in labels] == list(trace.KINDS)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["worker 0", "worker 1"]
    assert [t.get_text() for t in ax.texts] == ["0", "0"]               # a clock number every 5th step


def test_the_title_says_the_mode_once():
    assert trace.title("async", {"mode": "async", "workers": 4}, "steps 0-29") == "async, 4 workers: steps 0-29"
    assert (trace.title("straggler", {"mode": "sync", "workers": 3}, "steps 0-29")
            == "sync, 3 workers: steps 0-29 (straggler)")
    assert trace.title("old", {}, "steps 0-29") == "old: steps 0-29"


def test_a_run_without_worker_end_starts_at_its_first_step(tmp_path):
    run = write_run(tmp_path / "crashed", [step(0, 0, START + 1.0), step(0, 1, START + 1.1)])
    steps, origin, _ = trace.load(run)
    assert origin == pytest.approx(START + 1.0 - 0.025)


@pytest.mark.parametrize("make, args, message", [
    (lambda p: p / "nothing", [], "no such run folder"),
    (lambda p: write_run(p / "empty", []), [], "no step events"),
    (lambda p: write_run(p / "evals", [{"event": "eval", "version": 0}]), [], "no step events"),
    (lambda p: sync_like(p / "run", steps=3), ["--steps", "10:20"], "has clocks 0..2"),
    (lambda p: sync_like(p / "run", steps=3), ["--steps", "3"], "--steps takes A:B"),
])
def test_errors_are_one_line_and_exit_2(tmp_path, make, args, message):
    r = psgd_main("trace", str(make(tmp_path)), *args)
    assert r.returncode == 2 and message in r.stderr
    assert r.stderr.startswith("psgd trace: error:") and r.stderr.count("\n") == 1


# A real run's trace: tests/test_readme.py traces the README's async run.


def test_clock_labels_never_overlap_on_a_row(tmp_path):
    """Issue 54, item 6: trace.png's step labels overlapped where a slow worker stretched the window
    and a fast one's every 5th step stood closer than a label is wide."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    def steps(rank: int, n: int, dur: float) -> list:
        return [trace.Segment(rank, c, k, c * dur + i * dur / 4, c * dur + (i + 1) * dur / 4)
                for c in range(n) for i, k in enumerate(trace.KINDS)]
    segs = steps(0, 300, 0.001) + steps(1, 300, 0.02)   # worker 0 twenty times as fast
    fig = trace.draw(segs, tmp_path / "t.png", "t")
    renderer = FigureCanvasAgg(fig).get_renderer()
    for rank in (0, 1):
        boxes = sorted((b.x0, b.x1) for t in fig.axes[0].texts if abs(t.get_position()[1] - (rank - 0.38)) < 1e-9
                       for b in [t.get_window_extent(renderer)])
        assert len(boxes) >= 2 and all(a1 <= b0 for (_, a1), (b0, _) in zip(boxes, boxes[1:], strict=False)), rank
