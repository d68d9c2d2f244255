"""`--tensorboard DIR`: a run's curves as TensorBoard event files, written while it trains.

Contract:
- `Follower(out, logdir, workers)` (the launcher starts one per attempt of a run given a logdir:
  `psgd run --tensorboard DIR`, `psgd.fit(tensorboard=DIR)`, `psgd suite --tensorboard DIR`) is a
  thread of the launcher that tails OUT/metrics.jsonl, the file the workers and the launcher
  already append to, and writes each scalar into `logdir` as it appears: `tensorboard --logdir
  DIR` shows a run's curves growing while it trains. `close()` reads what is left, writes the
  end-of-run scalars from summary.json, and closes the file.
- One TensorBoard run per psgd run: `run_dir(DIR, out)` is DIR/<the run folder's name> (the
  SummaryWriter runs/ convention), so runs given one DIR sit side by side (the suite names its
  own: DIR/<experiment>/<label>-<phase>-lr<lr>-s<seed>).
- The scalars:
  - `train/loss` per update (the mean over the workers' steps of that clock), x = the clock;
    a clock is written once every worker still running has reported it (in clock order), or
    when `MAX_PENDING` later clocks wait behind it (a worker that joins late, --elastic), or at
    the end;
  - `step/{compute,push,pull,wait}_ms` per update (mean over workers), `step/clock_gap` (the
    widest gap between a worker and the slowest, the staleness SSP bounds), with the loss;
  - `eval/{test,val,train}_{loss,accuracy}` at every snapshot, x = training samples (the suite's
    common grid, so runs of different batch sizes line up), each as the launcher evaluates it;
  - `run/staleness_{mean,p99,max}`, `run/samples_per_s`, `run/updates_per_s`, `run/bytes_per_step`
    (once, at the last update, from summary.json: the shards count staleness when they stop).
- Without slowing the workers: the follower is a thread of the launcher (which only waits while
  the children train), at a lower CPU priority than they are (nice +10, per thread on Linux), and
  it imports neither torch nor TensorFlow: `EventFile` writes TensorBoard's file format (TFRecord
  framing of its Event protos, from the tensorboard package) itself, about 40 ms of imports.
  Each clock is one record holding all its scalars, flushed at every read of the file.
- `write(out, logdir)`: the same scalars from a finished run's files, after the fact (`psgd
  summarize OUT --tensorboard DIR`, the suite's cached runs, runs made before this existed).

TensorBoard is an optional extra (`pip install 'psgd[tensorboard]'`): `require()` says so in one
line (exit 2) before anything starts when it is asked for and not installed. psgd's own figures
stay matplotlib's.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from psgd.core.errors import UsageError
from psgd.train.metrics import read_events

POLL_S = 0.25       # how often the follower reads the metrics file for new lines
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
    """Where run `out`'s curves go under `--tensorboard DIR`: DIR/<the run folder's name>."""
    return Path(logdir) / Path(out).resolve().name


# -- the file format: TFRecord framing of Event protos ---------------------------------------------
def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    table = _TABLE
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class EventFile:
    """One TensorBoard event file in `logdir` (what SummaryWriter writes, without torch or TF)."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: PLC0415 - optional extra

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        logdir.mkdir(parents=True, exist_ok=True)
        self.path = logdir / f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}.psgd"
        self._f = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        self._record(self._event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        self.flush()

    def _record(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._f.write(header + struct.pack("<I", _masked(header)) + data + struct.pack("<I", _masked(data)))

    def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        """One record: every (tag, value) of `values` at `step`."""
        if not values:
            return
        summary = self._summary(value=[self._summary.Value(tag=t, simple_value=float(v)) for t, v in values.items()])
        self._record(self._event(wall_time=wall_time or time.time(), step=int(step), summary=summary)
                     .SerializeToString())

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


# -- from metrics.jsonl's events to scalars ---------------------------------------------------------
class Scalars:
    """Turns the run's events, in file order, into scalars on an EventFile (see the module docstring)."""

    def __init__(self, file: EventFile, workers: int) -> None:
        self.file, self.workers = file, workers
        self.rows: dict[int, list[dict]] = defaultdict(list)
        self.gone: set[int] = set()  # ranks that ended or were lost: no more steps from them
        self.last_clock = 0
        self.points = 0  # scalars written (tests, and the report of how live it was)

    def add(self, e: dict) -> None:
        kind = e.get("event")
        if kind == "step":
            self.rows[int(e["clock"])].append(e)
            self._emit_ready()
        elif kind in ("worker_end", "worker_lost"):
            self.gone.add(e.get("rank"))
            self._emit_ready()
        elif kind == "eval" and "version" in e:
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
        rows = self.rows.pop(clock)
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
            staleness = summary.get("staleness") or {}
            for key in ("mean", "p99", "max"):
                if staleness.get(key) is not None:
                    values[f"run/staleness_{key}"] = staleness[key]
            for key in ("samples_per_s", "updates_per_s", "bytes_per_step"):
                if summary.get(key) is not None:
                    values[f"run/{key}"] = summary[key]
            self.file.scalars(self.last_clock, values)
            self.points += len(values)
        self.file.flush()


def _summary(out: Path) -> dict | None:
    try:
        return json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def write(out: Path, logdir: Path, workers: int | None = None) -> Path:
    """Write finished run `out`'s scalars into `logdir` (see the module docstring); returns `logdir`."""
    require()
    out = Path(out)
    if workers is None:
        try:
            workers = int(json.loads((out / "config.json").read_text()).get("workers", 1))
        except (OSError, ValueError, AttributeError):
            workers = 1
    file = EventFile(Path(logdir))
    try:
        scalars = Scalars(file, workers)
        for e in read_events(out / "metrics.jsonl"):
            scalars.add(e)
        scalars.finish(_summary(out))
    finally:
        file.close()
    return Path(logdir)


class Follower:
    """The launcher's thread that writes a run's scalars as they happen (see the module docstring)."""

    def __init__(self, out: Path, logdir: Path, workers: int) -> None:
        require()
        self.out, self.path = Path(out), Path(out) / "metrics.jsonl"
        self.file = EventFile(Path(logdir))
        self.scalars = Scalars(self.file, workers)
        self._stop = threading.Event()
        self._ino: int | None = None
        self._offset, self._partial = 0, b""
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
        """The complete lines appended since the last read (a replaced file is read from its start)."""
        try:
            f = open(self.path, "rb")  # noqa: SIM115
        except FileNotFoundError:
            return
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino != self._ino or st.st_size < self._offset:
                self._ino, self._offset, self._partial = st.st_ino, 0, b""
            f.seek(self._offset)
            data = f.read()
        if not data:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            if line.strip():
                try:
                    self.scalars.add(json.loads(line))
                except ValueError:
                    continue
        self.file.flush()

    def close(self) -> None:
        """Stop the thread, write what is left and the end-of-run scalars, close the file."""
        self._stop.set()
        self._thread.join()
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
