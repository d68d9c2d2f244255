"""`--tensorboard DIR`: a run's curves as TensorBoard event files, written while it trains.

Contract:
- `Follower(out, logdir, workers)` (the launcher starts one per attempt of a run given a logdir:
  `psgd run --tensorboard DIR`, `psgd.fit(tensorboard=DIR)`, `psgd suite --tensorboard DIR`) is a
  thread of the launcher that tails OUT/metrics.jsonl, the file the workers and the launcher
  already append to, and writes each scalar into `logdir` as it appears: `tensorboard --logdir
  DIR` shows a run's curves growing while it trains. `close()` reads what is left, writes the
  end-of-run scalars from summary.json, and closes the file.
- One TensorBoard run per psgd run: `run_dir(DIR, out)` is DIR/<the run folder's name>-<a hash of its
  full path> (the SummaryWriter runs/ convention, made unique: `--out a/r` and `--out b/r` are two
  runs, and one folder run again is the same run), so runs given one DIR sit side by side (the
  suite names its own: DIR/<experiment>/<label>-<phase>-lr<lr>-s<seed>).
- The scalars, one point per x and x only growing:
  - `train/loss` per update. Sync and SSP (clocks at most s apart): the mean over the workers'
    steps of that clock, x = the clock; a clock is written once every worker still running has
    reported it (in clock order), or when `MAX_PENDING` later clocks wait behind it (a worker that
    joins late, --elastic); a row that comes after its clock was written is left out of the curve
    (`Scalars.late` counts them). Async (`per_update`, from config.json's mode): each worker step
    is an update of its own, x = the updates seen so far in the file's order, so workers any
    number of clocks apart never write a step twice;
  - `step/{compute,push,pull,wait}_ms` per update (mean over workers), `step/clock_gap` (the
    widest gap between a worker and the slowest, the staleness SSP bounds), with the loss;
  - `eval/{test,val,train}_{loss,accuracy}` at every snapshot, x = training samples (the suite's
    common grid, so runs of different batch sizes line up), each as the launcher evaluates it;
    with `live_eval` (`--live-eval`) the follower also starts psgd/train/liveeval.py, which evaluates
    the checkpoints while the run trains (OUT/eval-live.jsonl, tailed like the metrics), and stops
    it at `close()`; each x is written once, so the run's own evaluation adds only the others;
  - `run/staleness_{mean,p99,max}` (and `run/row_staleness_*` with --embeddings rows),
    `run/samples_per_s`, `run/updates_per_s`, `run/bytes_per_step` (once, at the last update, from
    summary.json: the shards count staleness when they stop).
- Without slowing the workers: the follower is a thread of the launcher (which only waits while
  the children train), at a lower CPU priority than they are (nice +10, per thread on Linux), and
  it imports neither torch nor TensorFlow: `EventFile` (tfevents.py) writes TensorBoard's file format (TFRecord
  framing of its Event protos, from the tensorboard package) itself, a light import.
  Each clock is one record holding all its scalars, flushed at every read of the file.
- `write(out, logdir)`: the same scalars from a finished run's files, after the fact (`psgd
  summarize OUT --tensorboard DIR`, the suite's cached runs, runs made before this existed).

TensorBoard is an optional extra (`pip install 'psgd[tensorboard]'`): `require()` says so in one
line (exit 2) before anything starts when it is asked for and not installed. psgd's own figures
stay matplotlib's.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

from psgd.core.errors import UsageError
from psgd.train import liveeval
from psgd.train.metrics import read_events
from psgd.train.tfevents import EventFile

POLL_S = 0.25       # how often the follower reads the metrics file for new lines
EVALUATOR_WAIT_S = 30.0  # how long close() lets the live evaluation finish the version it is on
MAX_PENDING = 256   # clocks waiting behind an incomplete one before it is written as it is
PARTS = ("compute", "push", "pull", "wait")
EVAL_KEYS = ("test_loss", "test_accuracy", "val_loss", "val_accuracy", "train_loss", "train_accuracy")


def require() -> None:
    """UsageError unless TensorBoard's event protos can be imported here."""
    try:
        from tensorboard.compat.proto import event_pb2  # noqa: F401, PLC0415
    except ImportError:
        raise UsageError("--tensorboard needs TensorBoard: pip install 'psgd[tensorboard]' (or pip install "
                         "tensorboard)") from None


def run_dir(logdir: Path, out: Path) -> Path:
    """Where run `out`'s curves go under `--tensorboard DIR`: DIR/<the run folder's name>-<8 hex digits
    of its absolute path's SHA-1>, so two folders of one name are two TensorBoard runs."""
    full = Path(out).resolve()
    return Path(logdir) / f"{full.name}-{hashlib.sha1(str(full).encode()).hexdigest()[:8]}"


# -- from metrics.jsonl's events to scalars ---------------------------------------------------------
class Scalars:
    """Turns the run's events, in file order, into scalars on an EventFile (see the module docstring)."""

    def __init__(self, file: EventFile, workers: int, per_update: bool = False) -> None:
        self.file, self.workers, self.per_update = file, workers, per_update
        self.rows: dict[int, list[dict]] = defaultdict(list)
        self.gone: set[int] = set()  # ranks that ended or were lost: no more steps from them
        self.last_clock = -1  # the last x written to the train/ and step/ curves
        self.late = 0  # rows whose clock was already written (left out of the curve)
        self.points = 0  # scalars written (tests, and the report of how live it was)
        self.evaluated: set[int] = set()  # the x of every eval point written

    def add(self, e: dict) -> None:
        kind = e.get("event")
        if kind == "step" and self.per_update:
            self._write_rows(self.last_clock + 1, [e])
        elif kind == "step":
            clock = int(e["clock"])
            if clock <= self.last_clock:
                self.late += 1
                return
            self.rows[clock].append(e)
            self._emit_ready()
        elif kind in ("worker_end", "worker_lost"):
            self.gone.add(e.get("rank"))
            self._emit_ready()
        elif kind == "eval" and "version" in e and e["samples"] not in self.evaluated:
            self.evaluated.add(e["samples"])  # once: evaluated live (--live-eval), then by the run
            values = {f"eval/{k}": e[k] for k in EVAL_KEYS if e.get(k) is not None}
            self.file.scalars(e["samples"], values, e.get("time"))
            self.points += len(values)

    def _emit_ready(self) -> None:
        # A clock is ready when every worker still running has reported it: a worker that ended
        # after its own row of this clock was counted (its worker_end may come before another
        # worker's last step line: counting gone workers off N instead emitted that clock twice).
        while self.rows:
            first = min(self.rows)
            reported = {r.get("rank") for r in self.rows[first]}
            waiting = set(range(self.workers)) - self.gone - reported
            if waiting and len(self.rows) <= MAX_PENDING:
                return
            self._emit(first)

    def _emit(self, clock: int) -> None:
        self._write_rows(clock, self.rows.pop(clock))

    def _write_rows(self, clock: int, rows: list[dict]) -> None:
        n = len(rows)
        values = {"train/loss": sum(r["loss"] for r in rows) / n}
        for part in PARTS:
            values[f"step/{part}_ms"] = 1000 * sum(r.get(f"{part}_s", 0.0) for r in rows) / n
        values["step/clock_gap"] = max(r.get("clock_gap", 0) for r in rows)
        self.file.scalars(clock, values, max(r.get("time", 0.0) for r in rows) or None)
        self.points += len(values)
        self.last_clock = max(self.last_clock, clock)

    def finish(self, summary: dict | None) -> None:
        """The clocks still waiting (in order), then the end-of-run scalars from `summary`."""
        for clock in sorted(self.rows):
            self._emit(clock)
        if summary:
            values = {}
            # Per-row staleness too, with embedding rows by key (summary.json's rows, psgd/train/rowfinish.py).
            for prefix, staleness in (("staleness", summary.get("staleness") or {}),
                                      ("row_staleness", (summary.get("rows") or {}).get("staleness") or {})):
                for key in ("mean", "p99", "max"):
                    if staleness.get(key) is not None:
                        values[f"run/{prefix}_{key}"] = staleness[key]
            for key in ("samples_per_s", "updates_per_s", "bytes_per_step"):
                if summary.get(key) is not None:
                    values[f"run/{key}"] = summary[key]
            self.file.scalars(max(self.last_clock, 0), values)
            self.points += len(values)
        self.file.flush()


def _summary(out: Path) -> dict | None:
    try:
        return json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _config(out: Path) -> dict:
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _scalars(file: EventFile, out: Path, workers: int | None) -> Scalars:
    """The Scalars of run `out`: its worker count (unless given) and its mode from config.json."""
    config = _config(out)
    if workers is None:
        workers = int(config.get("workers", 1) or 1)
    return Scalars(file, workers, per_update=config.get("mode") == "async")


def write(out: Path, logdir: Path, workers: int | None = None) -> Path:
    """Write finished run `out`'s scalars into `logdir` (see the module docstring); returns `logdir`."""
    require()
    out = Path(out)
    file = EventFile(Path(logdir))
    try:
        scalars = _scalars(file, out, workers)
        for e in read_events(out / "metrics.jsonl"):
            scalars.add(e)
        scalars.finish(_summary(out))
    finally:
        file.close()
    return Path(logdir)


class _Tail:
    """A file that others append JSON lines to: the complete lines since the last read (a replaced
    file is read from its start)."""

    def __init__(self, path: Path) -> None:
        self.path, self._ino, self._offset, self._partial = path, None, 0, b""

    def read(self) -> list[dict]:
        try:
            f = open(self.path, "rb")  # noqa: SIM115
        except FileNotFoundError:
            return []
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino != self._ino or st.st_size < self._offset:
                self._ino, self._offset, self._partial = st.st_ino, 0, b""
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        got = []
        for line in lines:
            if line.strip():
                try:
                    got.append(json.loads(line))
                except ValueError:
                    continue
        return got


class Follower:
    """The launcher's thread that writes a run's scalars as they happen (see the module docstring)."""

    def __init__(self, out: Path, logdir: Path, workers: int, live_eval: bool = False) -> None:
        require()
        self.out = Path(out)
        self.file = EventFile(Path(logdir))
        self.scalars = _scalars(self.file, self.out, workers)
        self._stop = threading.Event()
        self.tails = [_Tail(self.out / "metrics.jsonl")]
        self.evaluator: subprocess.Popen | None = None
        if live_eval:  # psgd/train/liveeval.py: the checkpoints evaluated as they are written
            self.tails.append(_Tail(self.out / liveeval.FILE))
            with open(self.out / "logs" / "live-eval.log", "ab") as log:
                self.evaluator = subprocess.Popen([sys.executable, "-m", "psgd.train.liveeval", str(self.out)],
                                                  stdin=subprocess.PIPE, stdout=log, stderr=log)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="psgd-tensorboard", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if sys.platform.startswith("linux"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only
            except OSError:
                pass
        try:
            while not self._stop.wait(POLL_S):
                self._read()
        except BaseException as e:  # noqa: BLE001 - TensorBoard is a view: it never fails the run
            self.error = e

    def _read(self) -> None:
        for tail in self.tails:
            for e in tail.read():
                self.scalars.add(e)
        self.file.flush()

    def close(self) -> None:
        """Stop the thread (and the live evaluation: its stdin closed, waited for), write what is left
        and the end-of-run scalars, close the file."""
        self._stop.set()
        self._thread.join()
        if self.evaluator is not None:
            self.evaluator.stdin.close()
            try:
                self.evaluator.wait(EVALUATOR_WAIT_S)  # the version it is on, at most
            except subprocess.TimeoutExpired:
                self.evaluator.kill()
                self.evaluator.wait()
        try:
            if self.error is None:
                self._read()
                self.scalars.finish(_summary(self.out))
        finally:
            self.file.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
