"""`--tensorboard DIR` (psgd/train/tboard.py): a run's curves, read back with TensorBoard's own reader and,
while the run trains, from TensorBoard's own server."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from psgd.train import tboard
from tests.helpers import ENV, psgd_main, summary

# The runs this file makes in this process fork from one warm parent (tests/warm.py).
pytestmark = pytest.mark.usefixtures("warm_runs")


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_run_writes_its_curves_and_summarize_writes_them_again(tmp_path):
    out, tb = tmp_path / "run", tmp_path / "tb"
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--steps", "30", "--eval-every", "10", "--dataset",
                  "synthetic", "--num-samples", "600", "--batch-size", "8", "--out", str(out), "--quiet",
                  "--tensorboard", str(tb))
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tb.iterdir()] == [tboard.run_dir(tb, out).name], "DIR/<run folder name>-<hash>"
    assert tboard.run_dir(tb, out).name.startswith("run-")
    got = scalars(tboard.run_dir(tb, out))
    assert {"train/loss", "eval/test_loss", "eval/test_accuracy", "step/compute_ms", "run/staleness_mean",
            "run/samples_per_s"} <= set(got)
    assert [step for step, _ in got["train/loss"]] == list(range(30)), "one point per clock"
    s = summary(out)
    assert got["run/samples_per_s"][0][1] == pytest.approx(s["samples_per_s"], rel=1e-6)
    assert got["eval/test_loss"][-1][1] == pytest.approx(s["final_test_loss"], rel=1e-6)
    again = tmp_path / "tb2"
    assert psgd_main("summarize", str(out), "--quiet", "--tensorboard", str(again)).returncode == 0
    assert scalars(tboard.run_dir(again, out))["train/loss"] == got["train/loss"]


def test_without_tensorboard_it_is_one_line_and_exit_2(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tensorboard(name, *args, **kw):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    r = psgd_main("run", "--steps", "2", "--out", str(tmp_path / "never"), "--tensorboard", str(tmp_path / "tb"))
    assert r.returncode == 2 and "pip install 'psgd[tensorboard]'" in r.stderr
    assert not (tmp_path / "never").exists()


DEADLINE_S = 120.0
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 directly


def _poll(what, found, *alive: subprocess.Popen):
    """`found()` once it is truthy; fail at the deadline, or as soon as a process in `alive` ended."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        for p in alive:
            assert p.poll() is None, f"{p.args[:4]} ended (code {p.returncode}) before {what}"
        got = found()
        if got:
            return got
        time.sleep(0.1)  # polling a condition, with a deadline
    raise AssertionError(f"no {what} within {DEADLINE_S:.0f}s")


def _get(url: str):
    try:
        with NO_PROXY.open(url, timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _stop(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        p.send_signal(sig)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def test_tensorboard_shows_a_run_while_it_trains(tmp_path):
    """TensorBoard's own server, on 127.0.0.1, serves psgd's points before the run has ended."""
    out, tb = tmp_path / "live", tmp_path / "tb"
    name = tboard.run_dir(tb, out).name  # TensorBoard's name for the run: the folder under tb
    run = subprocess.Popen([sys.executable, "-m", "psgd", "run", "--mode", "async", "--workers", "2", "--steps",
                            "1000000", "--dataset", "synthetic", "--num-samples", "600", "--batch-size", "8", "--out",
                            str(out), "--quiet", "--tensorboard", str(tb)], env=ENV, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    board = None
    try:
        _poll("the run's event file", lambda: list(tboard.run_dir(tb, out).glob("events.out.tfevents.*")),
              run)
        # Port 0: TensorBoard binds a free port itself and prints it.
        board = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(tb), "--host", "127.0.0.1",
                                  "--port", "0", "--load_fast", "false", "--reload_interval", "1"], env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        url = None
        for line in board.stdout:
            m = re.search(r"(http://127\.0\.0\.1:\d+)/", line)
            if m:
                url = m.group(1)
                break
        assert url, "TensorBoard printed no address"
        threading.Thread(target=board.stdout.read, daemon=True).start()  # its log never fills the pipe
        tags = _poll("psgd's tags in TensorBoard", lambda: ((_get(f"{url}/data/plugin/scalars/tags") or {})
                                                            .get(name, {}).get("train/loss") is not None
                                                            and _get(f"{url}/data/plugin/scalars/tags")), run, board)
        assert {"train/loss", "step/compute_ms", "step/push_ms", "step/pull_ms", "step/wait_ms",
                "step/clock_gap"} <= set(tags[name])

        def points():
            got = _get(f"{url}/data/plugin/scalars/scalars?run={name}&tag=train/loss") or []
            return got if len(got) >= 20 else None

        got = _poll("20 points of train/loss", points, run, board)
        assert run.poll() is None, "read while the run trains"
        steps = [step for _, step, _ in got]  # [wall_time, step, value]
        assert steps == list(range(len(steps))), "one point per update, in order"
        assert all(math.isfinite(v) for _, _, v in got)
    finally:
        _stop(run, signal.SIGINT)
        if board is not None:
            _stop(board, signal.SIGTERM)
    assert run.returncode != 0, "interrupted, not finished"


def test_fit_writes_its_curves_into_a_run_folder_of_their_own(tmp_path):
    import psgd

    tb = tmp_path / "tb"
    r = psgd.fit(steps=12, workers=2, out=str(tmp_path / "fitrun"), tensorboard=tb)
    got = scalars(tboard.run_dir(tb, tmp_path / "fitrun"))
    assert [step for step, _ in got["train/loss"]] == list(range(12))
    assert got["run/samples_per_s"][0][1] == pytest.approx(r.summary["samples_per_s"], rel=1e-6)


class Points:
    """An EventFile's stand-in that keeps what it is given."""

    def __init__(self):
        self.points = []

    def scalars(self, step, values, wall=None):
        self.points.append((step, values))

    def flush(self):
        pass


def test_a_workers_end_read_before_anothers_last_step_does_not_emit_that_clock_twice():
    """Worker 0's worker_end can reach metrics.jsonl before worker 1's last step line (seen on a
    loaded machine): clock 1 is then emitted once, when worker 1's row arrives, over both rows."""
    f = Points()
    sc = tboard.Scalars(f, workers=2)
    for e in [dict(event="step", rank=0, clock=0, loss=1.0), dict(event="step", rank=1, clock=0, loss=3.0),
              dict(event="step", rank=0, clock=1, loss=1.0), dict(event="worker_end", rank=0),
              dict(event="step", rank=1, clock=1, loss=5.0), dict(event="worker_end", rank=1)]:
        sc.add(e)
    sc.finish(None)
    assert [(step, v["train/loss"]) for step, v in f.points] == [(0, 2.0), (1, 3.0)]


def test_async_workers_far_apart_write_each_step_once_and_x_only_grows():
    """Async workers drift any number of clocks apart (worker 1 here 2 * MAX_PENDING behind): each
    step line is one point, x the updates seen, never written twice or backwards."""
    f = Points()
    sc = tboard.Scalars(f, workers=2, per_update=True)
    lag = 2 * tboard.MAX_PENDING
    events = [dict(event="step", rank=0, clock=c, loss=1.0) for c in range(lag)]
    events += [dict(event="step", rank=1, clock=c, loss=2.0) for c in range(lag)]
    for e in events + [dict(event="worker_end", rank=0), dict(event="worker_end", rank=1)]:
        sc.add(e)
    sc.finish(None)
    steps = [step for step, v in f.points if "train/loss" in v]
    assert steps == list(range(2 * lag)), "one point per step line, x strictly growing"


def test_a_clock_written_before_its_late_row_is_not_written_again():
    """Sync with a late joiner: MAX_PENDING clocks behind clock 0 force it out; worker 1's row of
    clock 0 that comes after is left out (counted), never written at x = 0 again."""
    f = Points()
    sc = tboard.Scalars(f, workers=2)
    for c in range(tboard.MAX_PENDING + 2):
        sc.add(dict(event="step", rank=0, clock=c, loss=1.0))
    sc.add(dict(event="step", rank=1, clock=0, loss=9.0))
    sc.finish(None)
    steps = [step for step, v in f.points if "train/loss" in v]
    assert steps == sorted(set(steps)) and sc.late == 1


def test_two_run_folders_of_one_name_are_two_tensorboard_runs(tmp_path):
    tb = tmp_path / "tb"
    a, b = tboard.run_dir(tb, tmp_path / "a" / "tbA"), tboard.run_dir(tb, tmp_path / "b" / "tbA")
    assert a != b and a.name.startswith("tbA-") and b.name.startswith("tbA-")
    assert tboard.run_dir(tmp_path / "tb", tmp_path / "a" / "tbA") == a  # the same folder again: the same run


TINY = ("--dataset", "synthetic", "--num-samples", "600", "--batch-size", "8", "--quiet")


def test_live_eval_evaluates_each_checkpoint_every_shard_holds_as_the_run_s_own_evaluation_does(tmp_path):
    """psgd/train/liveeval.py on a finished run: one pass (its stdin already closed) over the
    checkpoints both shards hold, each version's numbers the run's own evaluation of it."""
    from tests.helpers import events

    out = tmp_path / "run"
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--servers", "2", "--steps", "30", "--eval-every", "10",
                  "--checkpoint-every", "10", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "psgd.train.liveeval", str(out)], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    live = [json.loads(line) for line in (out / "eval-live.jsonl").read_text().splitlines()]
    own = {e["version"]: e for e in events(out) if e.get("event") == "eval"}
    assert [e["version"] for e in live] == [10, 20, 30]  # the three checkpoints a shard keeps
    for e in live:
        assert e["samples"] == own[e["version"]]["samples"]
        assert e["test_loss"] == pytest.approx(own[e["version"]]["test_loss"], rel=1e-5)
    r = subprocess.run([sys.executable, "-m", "psgd.train.liveeval", str(tmp_path)], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 2 and "not a psgd run folder" in r.stderr


def test_a_live_evaluated_run_draws_each_evaluation_once_and_live_eval_says_what_it_needs(tmp_path):
    out, tb = tmp_path / "run", tmp_path / "tb"
    r = psgd_main("run", "--mode", "sync", "--workers", "2", "--steps", "40", "--eval-every", "10",
                  "--checkpoint-every", "10", "--out", str(out), "--tensorboard", str(tb), "--live-eval", *TINY)
    assert r.returncode == 0, r.stderr
    steps = [step for step, _ in scalars(tboard.run_dir(tb, out))["eval/test_loss"]]
    assert sorted(steps) == sorted(set(steps)) == [v * 16 for v in range(0, 41, 10)]  # live or after, once each
    assert (out / "logs" / "live-eval.log").read_text() == ""  # the live evaluation ran without a word
    for flags, words in ((("--live-eval", "--checkpoint-every", "10"), "--tensorboard DIR"),
                         (("--live-eval", "--tensorboard", str(tb)), "--checkpoint-every K")):
        r = psgd_main("run", "--steps", "5", "--out", str(tmp_path / "no"), *flags, *TINY)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
