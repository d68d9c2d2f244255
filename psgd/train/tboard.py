"""`--tensorboard DIR`: a run's curves as TensorBoard event files, beside psgd's own metrics.

Contract: `write(out, logdir)` reads the finished run's OUT/metrics.jsonl and summary.json and
writes one TensorBoard run into `logdir` (`tensorboard --logdir DIR` shows it, and a suite's runs
side by side, one folder each, as each finishes):

- `train/loss` per update (the mean over the workers' steps of that clock), x = the clock;
- `eval/{test,val,train}_{loss,accuracy}` at every snapshot, x = training samples (the suite's
  common grid, so runs of different batch sizes line up);
- `step/{compute,push,pull,wait}_ms` per update (mean over workers), `step/clock_gap`;
- `run/staleness_{mean,p99,max}`, `run/samples_per_s`, `run/updates_per_s`, `run/bytes_per_step`
  (once, at the last update).

Written after the run from the files psgd already keeps, so it never slows training and a run made
without the flag can be written later (`psgd summarize OUT --tensorboard DIR`). TensorBoard is an
optional extra (`pip install 'psgd[tensorboard]'`): `require()` says so in one line (exit 2) before
anything starts when it is asked for and not installed. psgd's own figures stay matplotlib's.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from psgd.core.errors import UsageError
from psgd.train.metrics import read_events


def require() -> None:
    """UsageError unless TensorBoard's writer can be imported here."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401, PLC0415
    except ImportError:
        raise UsageError("--tensorboard needs TensorBoard: pip install 'psgd[tensorboard]' (or pip install "
                         "tensorboard)") from None


def write(out: Path, logdir: Path) -> Path:
    """Write run `out`'s scalars into `logdir` (see the module docstring); returns `logdir`."""
    require()
    from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

    events = read_events(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    steps: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("event") == "step":
            steps[int(e["clock"])].append(e)
    logdir.mkdir(parents=True, exist_ok=True)
    w = SummaryWriter(str(logdir))
    try:
        for clock in sorted(steps):
            rows = steps[clock]
            n = len(rows)
            w.add_scalar("train/loss", sum(r["loss"] for r in rows) / n, clock)
            for part in ("compute", "push", "pull", "wait"):
                w.add_scalar(f"step/{part}_ms", 1000 * sum(r[f"{part}_s"] for r in rows) / n, clock)
            w.add_scalar("step/clock_gap", max(r.get("clock_gap", 0) for r in rows), clock)
        for e in events:
            if e.get("event") == "eval" and "version" in e:
                for key in ("test_loss", "test_accuracy", "val_loss", "val_accuracy", "train_loss", "train_accuracy"):
                    if e.get(key) is not None:
                        w.add_scalar(f"eval/{key}", e[key], e["samples"])
        last = max(steps, default=0)
        staleness = summary.get("staleness") or {}
        for key in ("mean", "p99", "max"):
            if staleness.get(key) is not None:
                w.add_scalar(f"run/staleness_{key}", staleness[key], last)
        for key in ("samples_per_s", "updates_per_s", "bytes_per_step"):
            if summary.get(key) is not None:
                w.add_scalar(f"run/{key}", summary[key], last)
    finally:
        w.close()
    return logdir
