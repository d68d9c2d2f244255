"""Settings per room: `psgd server` takes a shard's settings and `psgd worker` a worker's; a flag given
to the wrong role is one line, exit 2; `-h` is a line a flag; `psgd run` hands each child its own
room's flags; and a traced run shows that neither room reads a setting it was not given."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from psgd.cli import build_parser
from psgd.core import config as C
from psgd.train import roles, serve, work
from tests.helpers import ENV, summary

RICH = C.validate(C.RunConfig(
    mode="ssp", workers=2, servers=2, staleness=1, steps=30, seed=4, eval_every=10, topk=0.5,
    topk_warmup_epochs=0.1, staleness_lr=True, dc_lambda=0.1, dc_adaptive=True, skip_nonfinite=True,
    checkpoint_every=10, worker_lease=30.0, wire_dtype="fp16", straggler=((0, 1),), jitter=1.0,
    transport="grpc", separate_pull=True, token_file="",
    data=C.DataConfig(num_samples=600, shard_data="noniid", data_seed=3), optim=C.OptimConfig(lr=0.03)))


def parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("argv,says", [
    (["server", "--shard", "0", "--seed", "3"], "--seed is a worker's setting, not a shard's: give it to psgd worker"),
    (["server", "--shard", "0", "--no-error-feedback"], "--no-error-feedback is a worker's setting"),
    (["server", "--shard", "0", "--straggler", "0=5"], "--straggler is a worker's setting"),
    (["worker", "--rank", "0", "--staleness", "3"], "--staleness is a shard's setting, not a worker's: give it to "
                                                    "psgd server"),
    (["worker", "--rank", "0", "--checkpoint-every", "5"], "--checkpoint-every is a shard's setting"),
    (["worker", "--restart-workers", "1"], "--restart-workers is psgd run's setting"),
    (["server", "--shard", "0", "--cpu-quota", "0.5"], "--cpu-quota is psgd run's setting"),
])
def test_a_flag_given_to_the_wrong_role_is_one_line_and_exit_2(argv, says, capsys):
    err = parse_error(argv, capsys)
    assert err.startswith(f"psgd {argv[0]}: error: {says}"), err


def test_every_setting_is_read_by_some_room_and_the_rooms_do_not_overlap():
    names = {leaf.name for leaf in C.leaves()}
    assert serve.OWN | work.OWN | roles.RUN_OWN <= names
    assert not serve.OWN & work.OWN and not (serve.OWN | work.OWN) & roles.RUN_OWN
    # psgd node may be either room: it takes every setting.
    assert not roles.not_read("shard").keys() & serve.OWN and not roles.not_read("worker").keys() & work.OWN


@pytest.mark.parametrize("command,room", [("server", "shard"), ("worker", "worker")])
def test_dash_h_is_a_line_a_setting_of_its_room_grouped_and_help_is_whole(command, room, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "-h"])
    short = capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    full = capsys.readouterr().out
    theirs = roles.not_read(room)
    for leaf in C.leaves():
        flag = "--" + leaf.name.replace("_", "-")
        lines = [ln for ln in short.splitlines() if ln.startswith(f"  {flag} ") or ln == f"  {flag}"
                 or ln.startswith(f"  {flag},")]
        assert len(lines) == (0 if leaf.name in theirs else 1), (flag, lines)
    for group in ("run:", "communication:", "security:", "data and model:", "optimizer"):
        assert f"\n{group}" in short
    assert len(short.splitlines()) < 110 < len(full.splitlines())


def test_psgd_run_hands_each_room_exactly_its_settings():
    for room, command, extra in (("shard", "server", ["--shard", "0"]), ("worker", "worker", ["--rank", "0"])):
        argv = roles.flags_for(RICH, room)
        theirs = roles.not_read(room)
        assert not any(a.lstrip("-").replace("-", "_") in theirs for a in argv if a.startswith("--"))
        got = C.from_namespace(build_parser().parse_args([command, *argv, *extra]))
        for leaf in C.leaves():
            value = getattr(getattr(got, leaf.section) if leaf.section else got, leaf.name)
            want = getattr(getattr(RICH, leaf.section) if leaf.section else RICH, leaf.name)
            assert value == (leaf.default if leaf.name in theirs else want), (room, leaf.name)


def test_a_traced_run_shows_each_room_reads_only_its_own_settings(tmp_path):
    """Every shard and worker of a run with most features on records each setting it reads
    (tests/rooms_trace/sitecustomize.py); a shard never reads a worker's setting nor a worker a
    shard's, and neither reads psgd run's. The run forks them from its own zygote, as `psgd run` does."""
    reads = tmp_path / "reads"
    reads.mkdir()
    env = {**ENV, "PSGD_TRACE_READS": str(reads),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "rooms_trace"), ENV.get("PYTHONPATH", "")])}
    cfg = dataclasses.replace(RICH, out=str(tmp_path / "run"))
    r = subprocess.run([sys.executable, "-m", "psgd", "run", *C.to_argv(cfg), "--quiet"],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    assert summary(tmp_path / "run")["global_updates"] == 60
    by_role: dict[str, set[str]] = {"server": set(), "worker": set()}
    for f in reads.glob("*.txt"):
        for line in f.read_text().splitlines():
            role, name = line.split()
            if role in by_role:
                by_role[role].add(name)
    shard, worker = by_role["server"], by_role["worker"]
    assert {"staleness", "checkpoint_every", "staleness_lr"} <= shard and {"seed", "wire_dtype", "jitter"} <= worker
    assert not shard & work.OWN, shard & work.OWN
    assert not worker & serve.OWN, worker & serve.OWN
    assert not (shard | worker) & roles.RUN_OWN



@pytest.mark.parametrize("command,module,bad,says", [
    ("server", serve, ["--shard", "0", "--seed", "3"], "--seed is a worker's setting"),
    ("worker", work, ["--rank", "0", "--staleness", "3"], "--staleness is a shard's setting"),
    ("server", serve, ["--shard", "0", "--port", "70000"], "--port must be in 0..65535"),
])
def test_a_forked_child_enters_its_room_main_not_the_cli(command, module, bad, says, capsys, tmp_path):
    """The zygote's forks call the room's main directly (three hops from psgd run to a serving
    shard: launch, zygote, the room); it parses and refuses as `psgd COMMAND` does."""
    from psgd.train import zygote

    assert zygote.ROOMS[command] == module.__name__
    try:
        code = module.main([*bad, "--out", str(tmp_path / "run")])
    except SystemExit as e:  # argparse's refusals exit; the room's own checks return the code
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"psgd {command}: error: {says}") and len(err.splitlines()) == 1, err
