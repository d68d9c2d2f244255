"""psgd's zygote (psgd/train/zygote.py) whose forks run a Python script, as `python SCRIPT ARGS` would.

`python -m tests.script_zygote TAG FD` is `python -m psgd.train.zygote TAG FD` (torch, numpy and psgd's
modules imported once, never gRPC; the same fork-safety checks, descriptors, environment, working
folder, session and PR_SET_PDEATHSIG for each child), but a request's argv is `SCRIPT ARGS`, and the
child runs SCRIPT as `__main__` (runpy.run_path: sys.argv, sys.path[0] and __file__ as the interpreter
sets them for a script) instead of `psgd ARGS`. At the script's end the child does what the
interpreter does at exit: it joins the non-daemon threads and runs the atexit handlers. Its exit
code is the script's (SystemExit's code; 1 with the traceback on stderr after an uncaught exception).

tests/warm.py `script_parent` starts one per test process; tests/test_examples.py runs the examples
through it, saving each example an interpreter start and a torch import (about 2 s of CPU).
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import tempfile
import threading
import types

from psgd.train import lifeline, zygote


def _run_script(*_args, **_kwargs) -> None:
    """Stands in for `runpy.run_module("psgd", ...)` in the zygote's child: sys.argv is ["psgd", SCRIPT, *ARGS]."""
    script, *args = sys.argv[1:]
    # The script's own children are not the zygote's: psgd's lifeline must not tie them to it.
    os.environ.pop(lifeline.LAUNCHER_PID, None)
    tempfile.tempdir = None  # read $TMPDIR again: the request's environment, not the zygote's
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads ...
        atexit._run_exitfuncs()  # ... then run the atexit handlers


# The zygote's child runs anything but a shard or a worker through runpy.run_module (psgd/train/zygote.py run_child).
zygote.runpy = types.SimpleNamespace(run_module=_run_script)

if __name__ == "__main__":
    forked = zygote.main()
    if forked is not None:
        zygote.run_child(forked)  # never returns
    os._exit(0)
