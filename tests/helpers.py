"""Helpers for tests that start real `psgd` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ENV = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")


def psgd(*args: str, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psgd", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, **kw)


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes whose arguments contain `text` (orphan check)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append(cmd)
    return found


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
