"""Loaded by every psgd process of tests/test_worker_frames.py (PYTHONPATH): a worker samples its main
thread's stack every millisecond and writes, in $PSGD_TRACE_FRAMES/PID.json, every distinct stack
seen inside its exchange (a frame of psgd/ps/exchange.py) with how often: its psgd frames as
`FILE:FUNCTION` from the process's first to the innermost, as py-spy would show them.

Forked children (the run's zygote) start their own sampler (os.register_at_fork); a process started
cold starts it here. Only a worker samples (its argv names the room)."""

import collections
import json
import os
import signal
import sys
import threading
import time

_DIR = os.environ.get("PSGD_TRACE_FRAMES")


def _psgd_frames(frame) -> list[str]:
    import psgd

    root = os.path.dirname(psgd.__file__)
    out = []
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(root):
            out.append(f"{os.path.relpath(code.co_filename, root)}:{code.co_name}")
        frame = frame.f_back
    return out[::-1]


def _sample() -> None:
    # Stop signals are for the process's own threads (a shard takes SIGTERM with sigwait in its main
    # thread, psgd/train/serve.py): a sampler that let one in would kill the process unsaved.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    seen: collections.Counter = collections.Counter()
    end = time.monotonic() + 120
    written = time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.001)
        if "worker" not in sys.argv:
            continue
        frame = sys._current_frames().get(threading.main_thread().ident)
        stack = _psgd_frames(frame) if frame is not None else []
        new = False
        if any(f.startswith("ps/exchange.py:") for f in stack):
            new = tuple(stack) not in seen
            seen[tuple(stack)] += 1
        # The worker leaves by os._exit: write as it goes (each new stack at once, the counts now and then).
        if new or (seen and time.monotonic() - written > 0.2):
            written = time.monotonic()
            # Whole or not at all: the worker's os._exit may come mid-write (a torn file read as JSON).
            path = os.path.join(_DIR, f"{os.getpid()}.json")
            with open(path + ".tmp", "w") as f:
                json.dump([[list(k), n] for k, n in seen.most_common()], f)
            os.replace(path + ".tmp", path)


def _start() -> None:
    threading.Thread(target=_sample, name="psgd-trace-frames", daemon=True).start()


if _DIR:
    os.register_at_fork(after_in_child=_start)
    _start()
