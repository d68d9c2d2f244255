"""The drill's storm (psgd/train/storm.py) against stand-in processes: which process a fault of a
`join` episode (kill a worker, then kill its replacement while it rejoins) takes for the replacement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from psgd.core.config import RunConfig
from psgd.train import proctitle
from psgd.train import storm as storm_mod
from psgd.train.storm import Fault, Storm

# A stand-in for a run's process: it takes the title a worker would, says so, and waits for its stdin.
_STAND_IN = ("import sys; from psgd.train import proctitle; proctitle.set_title(sys.argv[1]); "
             "print('titled', flush=True); sys.stdin.read()")


def _stand_in(title: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _STAND_IN, title], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline() == "titled\n"  # its title is set: the storm can find it now
    return p


def test_a_replacement_titled_before_the_storm_looks_again_is_still_the_join_episodes_target(tmp_path, monkeypatch):
    # The supervisor's replacement can be forked and titled between the storm's kill and its next
    # look at the run (a storm thread descheduled on a loaded machine). The kill below makes that
    # happen every time: it returns only once the replacement carries the worker's title. The
    # storm that listed the run's processes after the kill counted the replacement among the old
    # ones and never found a process to kill for the join (CI: 6 of 10 faults, the run ended first).
    out = str(tmp_path)
    cfg = RunConfig(mode="sync", workers=1, servers=1, steps=10, out=out)
    title = proctitle.title(proctitle.worker_name(0, 1), out)
    procs = [_stand_in(title)]
    real_kill = os.kill

    def kill_and_replace(pid: int, sig: int) -> None:
        real_kill(pid, sig)
        if len(procs) == 1:
            procs.append(_stand_in(title))  # the replacement, titled before the storm looks again
        else:  # the replacement is killed: the run "steps again", which ends the episode
            with open(tmp_path / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"event": "step", "rank": 0, "time": time.time() + 1}) + "\n")

    monkeypatch.setattr(storm_mod.os, "kill", kill_and_replace)
    monkeypatch.setattr(storm_mod, "WAIT_S", 20.0)  # only the failing storm ever waits this long
    storm_mod.forget()
    storm = Storm(cfg, [[Fault("worker", 0, "step"), Fault("worker", 0, "join")]], [0], tmp_path / "hold")
    try:
        storm.start()
        storm.join()
    finally:
        storm.stop.set()
        monkeypatch.undo()  # the real os.kill again for the cleanup below
        for p in procs:
            p.kill()
            p.wait()
    assert [(f.moment, f.pid) for f in storm.done] == [("step", procs[0].pid), ("join", procs[1].pid)]
    assert storm.error == ""
