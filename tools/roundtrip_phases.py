"""The small-model round trip, phase by phase (docs/architecture.md, "The round trip against its ceiling").

    .venv/bin/python tools/roundtrip_phases.py [--steps 4000] [--width 256] [--transport shm]

Runs psgd bench roundtrip's `shm` arm (async, one worker, one shard; --transport picks another)
for longer, with a sitecustomize that wraps psgd/ps/framing.py's `send_frame` and `recv_head`, and
the shm doorbell's `Bell.send` and `Bell.recv_head` (psgd/ps/shm/bell.py), in every process of the
run: each process appends (event, op, perf_counter) rows to a file of its own.
Then, from the steady state (the first 200 steps and the last few left out), the medians per step
of: the worker's send to the shard's read of that frame, the shard's work until it starts its
reply, the reply's start to the worker's read of it, the worker's own work from the reply to its
next send, and the step. perf_counter is CLOCK_MONOTONIC, one clock for every process of a host.
A measurement tool, not a benchmark: the wrappers add about a microsecond per frame.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SITE = '''
import os, time
import psgd.ps.framing as fr
_rows, _send, _recv = [], fr.send_frame, fr.recv_head
_path = os.path.join(os.environ["PSGD_PHASES"], "t-%d.txt")

def _add(row):
    _rows.append(row)
    if len(_rows) >= 4000:  # the processes end with os._exit: write as they go
        with open(_path % os.getpid(), "a") as f:
            f.write("".join("%s %d %.7f\\n" % r for r in _rows))
        _rows.clear()

def send_frame(sock, op, header, payload=None, on_chunk=None, length=None):
    _add(("s", op, time.perf_counter()))
    return _send(sock, op, header, payload, on_chunk, length)

def recv_head(sock, started=None):
    head = _recv(sock, started)
    _add(("R", head[0] if head else -1, time.perf_counter()))
    return head

fr.send_frame, fr.recv_head = send_frame, recv_head

import psgd.ps.shm.bell as bl  # a belled shm connection's frames go through its doorbell instead
_bsend, _brecv = bl.Bell.send, bl.Bell.recv_head

def bell_send(self, op, header, length):
    _add(("s", op, time.perf_counter()))
    return _bsend(self, op, header, length)

def bell_recv(self, *args, **kwargs):
    head = _brecv(self, *args, **kwargs)
    _add(("R", head[0] if head else -1, time.perf_counter()))
    return head

bl.Bell.send, bl.Bell.recv_head = bell_send, bell_recv
'''

RUN = '''
import sys
from pathlib import Path
from psgd.bench import roundtrip, transformer as tb
from psgd.train import launch
import dataclasses
cfg = tb.arm_config(roundtrip.workload("mlp" + sys.argv[1], int(sys.argv[2])), "shm", Path(sys.argv[3]))
launch.run(dataclasses.replace(cfg, transport=sys.argv[4]))
'''


def phases(folder: Path) -> dict[str, float]:
    """Medians in µs per step from the timestamp files in `folder`."""
    from psgd.ps import framing as fr

    rows = {f: [(a, int(b), float(c)) for a, b, c in (line.split() for line in f.read_text().splitlines())]
            for f in folder.glob("t-*.txt")}
    worker = next(f for f, r in rows.items() if any(a == "s" and op == fr.PUSHPULL for a, op, _ in r))
    shard = next(f for f, r in rows.items() if f != worker and any(op == fr.PUSHPULL for _, op, _ in r))

    def times(f: Path, event: str, op: int) -> list[float]:
        return [t for a, o, t in rows[f] if a == event and o == op]
    sent = times(worker, "s", fr.PUSHPULL)
    read = times(shard, "R", fr.PUSHPULL)
    # The first reply of each side answers the clock-0 pull, before the first PushPull.
    replied = times(shard, "s", fr.PULLED)[1:]
    back = times(worker, "R", fr.PULLED)[1:]
    n = min(len(sent), len(read), len(replied), len(back)) - 5
    if n <= 200:
        raise SystemExit(f"too few steps recorded ({n}): give --steps 1000 or more")
    steady = range(200, n)

    def med(xs) -> float:
        return round(statistics.median(xs) * 1e6, 1)
    return {"worker send -> shard read": med(read[i] - sent[i] for i in steady),
            "shard's work": med(replied[i] - read[i] for i in steady),
            "shard reply -> worker read": med(back[i] - replied[i] for i in steady),
            "worker: reply -> next send": med(sent[i + 1] - back[i] for i in steady),
            "step": med(sent[i + 1] - sent[i] for i in steady)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--transport", default="shm", choices=("shm", "tcp"))
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="psgd-phases-") as tmp:
        site, out = Path(tmp, "site"), Path(tmp, "run")
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITE)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
                   PSGD_PHASES=tmp)
        subprocess.run([sys.executable, "-c", RUN, str(a.width), str(a.steps), str(out), a.transport],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        for name, us in phases(Path(tmp)).items():
            print(f"{name:>28}: {us:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
