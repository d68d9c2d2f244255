"""A shard's checkpoints: written atomically with a checksum, read back only when intact.

Contract:
- `write(folder, shard, version, state, keep)` writes `shard-K-vVERSION.ckpt` in `folder`: the
  state (a dict of tensors and plain values, `torch.save`d) after a fixed preamble that holds a
  magic string, the payload's length and its SHA-256. It goes to a temporary file first, is
  fsync'd, renamed into place and the folder fsync'd: a crash leaves the old checkpoint or the new
  one, never half of one; a write that fails (ENOSPC, say) removes its temporary file and raises
  its OSError. Then all but the newest `keep` of this shard's checkpoints are deleted.
- `newest(folder, shard, upto=V)` returns (state, path) of the newest checkpoint (of a version
  <= V, when given: the shards of a sync run resume at one common version) of that shard whose
  preamble, length and checksum all hold, or None; each one skipped (truncated, bit-flipped, not a
  psgd checkpoint) is reported with its reason through `warn`, and never loaded.
- `versions(folder, shard)`: the versions of a shard's intact checkpoints, newest first.

- Drills (psgd/train/drill.py): with `$PSGD_CHECKPOINT_HOLD` naming a folder that holds a file
  `arm`, the next write of any shard takes it (renamed to `held-PID`, so one writer only), writes
  the preamble and half the payload to its temporary file, flushed, and waits there (until that
  file is removed, at most HOLD_S) for the drill to SIGKILL it mid-write. Without the variable,
  or the `arm` file, a write never waits.

Only files named like a checkpoint are read or deleted: the folder may hold anything else.
The payload is read with `torch.load(weights_only=True)`: a checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import struct
import time
from collections.abc import Callable
from pathlib import Path

import torch

MAGIC = b"PSGDCKP1"
PREAMBLE = struct.Struct("<8sQ32s")  # magic, payload length, sha256 of the payload
NAME = re.compile(r"shard-(\d+)-v(\d+)\.ckpt")
HOLD = "PSGD_CHECKPOINT_HOLD"  # a drill's folder (see the module docstring)
HOLD_S = 60.0


def path_of(folder: Path, shard: int, version: int) -> Path:
    return folder / f"shard-{shard}-v{version:010d}.ckpt"


def write(folder: Path, shard: int, version: int, state: dict, keep: int = 3) -> Path:
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    folder.mkdir(parents=True, exist_ok=True)
    final = path_of(folder, shard, version)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        _write_tmp(tmp, payload)
        os.replace(tmp, final)
    except BaseException:
        # A failed write (a full disk, an interrupt) leaves no partial file to hold the last of the space.
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    for _, old in _listed(folder, shard)[keep:]:
        old.unlink(missing_ok=True)
    return final


def _write_tmp(tmp: Path, payload: memoryview) -> None:
    with open(tmp, "wb") as f:
        f.write(PREAMBLE.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()))
        half = len(payload) // 2
        if os.environ.get(HOLD):
            f.write(payload[:half])
            f.flush()
            _hold(Path(os.environ[HOLD]))
            f.write(payload[half:])
        else:
            f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def newest(folder: Path, shard: int, warn: Callable[[str], None] = print,
           upto: int | None = None) -> tuple[dict, Path] | None:
    for version, path in _listed(folder, shard):
        if upto is not None and version > upto:
            continue
        data = path.read_bytes()  # read once: checked, then loaded from the same bytes
        why = _check(data)
        if why is None:
            return torch.load(io.BytesIO(memoryview(data)[PREAMBLE.size:]), weights_only=True), path
        warn(f"skipping checkpoint {path}: {why}")
    return None


def versions(folder: Path, shard: int) -> list[int]:
    return [v for v, path in _listed(folder, shard) if _check(path.read_bytes()) is None]


def _check(data: bytes) -> str | None:
    """Why these bytes are not an intact checkpoint, or None."""
    if len(data) < PREAMBLE.size:
        return "truncated (no complete preamble)"
    magic, length, digest = PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        return "not a psgd checkpoint"
    if len(data) - PREAMBLE.size != length:
        return f"truncated ({len(data) - PREAMBLE.size} of {length} payload bytes)"
    if hashlib.sha256(memoryview(data)[PREAMBLE.size:]).digest() != digest:
        return "checksum mismatch (corrupted)"
    return None


def _listed(folder: Path, shard: int) -> list[tuple[int, Path]]:
    """(version, path) of this shard's checkpoint files, newest first."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = NAME.fullmatch(p.name)
        if m and int(m.group(1)) == shard:
            found.append((int(m.group(2)), p))
    return sorted(found, reverse=True)


def _hold(folder: Path) -> None:
    """A drill's pause in the middle of a write (see the module docstring); returns at once unarmed."""
    held = folder / f"held-{os.getpid()}"
    try:
        os.rename(folder / "arm", held)
    except FileNotFoundError:
        return  # not armed, or another shard's write took it
    deadline = time.monotonic() + HOLD_S
    while held.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # a drill's hook, never in a run without $PSGD_CHECKPOINT_HOLD: it SIGKILLs us here


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
