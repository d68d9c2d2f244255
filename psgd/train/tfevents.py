"""TensorBoard's event file format, written without torch or TensorFlow.

Contract: `EventFile(logdir)` opens a new events.out.tfevents.* file in `logdir` (what SummaryWriter
writes): records in TFRecord framing (a length, its masked CRC-32C, the data, its masked CRC-32C)
holding serialised `Event` protos from the tensorboard package (an optional extra, imported when a
file is opened). `scalars(step, values)` writes one record of several scalars; `flush`, `close`.
CRC-32C is written out here (a table of 256 entries) because the standard library has only CRC-32:
a dependency for 15 lines would cost more to read than the lines themselves.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


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
