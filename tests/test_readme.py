"""Every command in the ```bash blocks of README.md and the docs moved out of it works as written.

DOCS names the files: README.md, then docs/guide.md, docs/measure.md and docs/results.md (issue 32
moved them out of the README, which stays the front door), read in that order as one text.

They run in order (later ones read what earlier ones wrote, as a reader's would) in a scratch
folder, each with a small budget appended: argparse keeps a flag's last value, so `--steps 300
--steps 3` is the README's command cut short. A command this test does not run must be listed in
NOT_RUN with the reason and the test that covers it instead; a new command in DOCS that is neither
run nor listed fails the test, so neither the README nor the docs moved out of it can rot unnoticed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import shlex
from pathlib import Path

import pytest

from tests.helpers import ENV, processes_mentioning, psgd_main

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/guide.md", "docs/measure.md", "docs/results.md")

# Appended to a command that starts with the key (the longest matching key wins).
BUDGETS = {
    "psgd run": ["--steps", "4", "--quiet"],
    "psgd run --mode sync --workers 2 --servers 4 --model wide_mlp": ["--steps", "2", "--width", "64", "--quiet"],
    # Your own model (examples/08's file, reached through the scratch folder's examples/ link):
    # --epochs 0 hands the budget back to --steps.
    "psgd run --model examples/08_your_model.py": ["--epochs", "0", "--steps", "4", "--quiet"],
    # The DLRM on click logs (docs/guide.md): the first names --epochs 3, which outranks --steps (4.4 s
    # of training in make test); --epochs 0 hands the budget back to --steps, as for the model above.
    "psgd run --model dlrm --dataset clicks": ["--epochs", "0", "--steps", "4", "--quiet"],
}

# Beyond the start-here walk (whose trace checks all 4 workers), a plain `psgd run` also gets fewer
# processes: the flags and the paths are the README's, and make test saves ~20 s of start-ups.
SMALLER = ["--workers", "2", "--servers", "1"]
SMALLER_KEYS = ("psgd run", "psgd run --model dlrm --dataset clicks")

# Not run here, with the reason and what covers it.
NOT_RUN = {
    "make install": "the environment this test runs in is what it makes (`make test` runs it first)",
    "make test": "this test is part of it",
    "make experiments": "ten minutes or more; tests/test_suite.py runs a tiny suite end to end",
    "make gpu-check": "for a GPU host (about 5 minutes there); tests/test_doctor.py runs its CPU-only path, "
                      "tests/test_gpu.py holds the gpu-marked tests it runs",
    "psgd server --port 50051": "needs hosts A and B; tests/test_by_hand.py runs the same recipe on 127.0.0.1",
    "psgd worker --rank 0 --servers hostA": "as above",
    "psgd summarize results/runs/by-hand": "as above (tests/test_by_hand.py summarizes its by-hand run)",
    "torchrun": "torchrun's c10d store sends reverse-DNS queries; tests/test_node.py runs `torchrun ... -m psgd "
                "node` in a network namespace of its own (only lo) and summarizes it, tests/test_by_hand.py starts "
                "the same `psgd worker --mode allreduce` processes as torchrun does, on a file:// rendezvous",
    # The benchmarks run in tests/test_bench*.py with small budgets (and their outputs checked);
    # running them twice would cost make test half a minute.
    "psgd bench transport": "tests/test_bench.py::test_transport_json",
    "psgd bench calibrate": "tests/test_bench.py::test_calibrate_then_model_then_scaling_with_validation",
    "psgd bench scaling": "as above",
    "psgd bench allreduce": "tests/test_bench_allreduce.py::test_bench_measures_both_implementations_as_json",
    "psgd bench peers": "tests/test_bench_peers.py",
    "psgd bench cluster": "minutes, and root; tests/test_bench.py checks its model's two floors, tests/test_cluster.py "
                          "its probe, calibrate --cluster's refusal and runs across hosts",
    # The README's cluster walk: each exec'd child on a host imports torch; tests/test_cluster.py runs
    # the same commands (up, status, exec, down, a sync PS and an all-reduce run across hosts, each
    # checked against the run on loopback).
    "psgd cluster": "tests/test_cluster.py::test_up_status_down_leaves_nothing_behind and its exec tests",
    "psgd run --hosts": "tests/test_cluster.py::test_a_sync_ps_run_across_hosts_equals_the_run_on_loopback and "
                        "::test_an_allreduce_run_across_hosts_equals_the_run_on_loopback",
    "psgd bench utilisation": "minutes, and root; tests/test_bench_utilisation.py checks its runs, its utilisation "
                              "arithmetic, the model's amortised step and the table",
    # A run costs make test about 3 s of start-up; the same sparse pushes go through in-process shards.
    "psgd run --mode sync --workers 4 --topk": "tests/test_sparsify.py (both transports, --link pacing included)",
    # The transformer's two runs cost make test about 6 s; the same flags run in tests of their own.
    "psgd run --model gpt --dataset text": "tests/test_gpt.py (a short AdamW run through the PS beats the unigram "
                                           "baseline), tests/test_diloco.py (--local-steps --outer nesterov, PS and "
                                           "all-reduce, against torch replicas)",
    # The examples run in tests/test_examples.py, which checks that the README's are among its cases.
    "python examples/": "tests/test_examples.py::test_example_runs_and_holds_its_claims",
    "diff examples/08_your_model.py": "tests/test_examples.py::test_psgd_is_a_few_lines_from_the_plain_loop",
}

# The start-here path: each command reads what the one before wrote.
WALK = ("psgd run --mode sync --workers 4 --servers 2", "psgd run --mode async --workers 4 --servers 2 --model mlp "
        "--dataset mnist1d --steps 300 --out", "psgd plot", "psgd trace")


def readme_commands(text: str) -> list[str]:
    """The commands of every ```bash block: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.split(r"\s+#", line, maxsplit=1)[0].strip()
            if command:
                commands.append(command)
    return commands


def docs_commands() -> list[str]:
    """The commands of DOCS, in order: the README's first, then each moved file's."""
    return [c for doc in DOCS for c in readme_commands((ROOT / doc).read_text())]


def longest_key(command: str, table: dict) -> str | None:
    keys = [k for k in table if command.startswith(k)]
    return max(keys, key=len) if keys else None


def test_every_readme_command_is_run_or_says_why_not():
    readme = readme_commands((ROOT / "README.md").read_text())
    assert len(readme) >= 10, "the README lost its commands (or this parser broke)"
    assert {"make test", "make experiments"} <= set(readme), "the README's two commands left it"
    assert all(readme_commands((ROOT / doc).read_text()) for doc in DOCS[1:3]), "a moved doc lost its commands"
    commands = docs_commands()
    assert len(commands) >= 40, "the docs lost their commands (or this parser broke)"
    unaccounted = [c for c in commands if not c.startswith("psgd ") and not longest_key(c, NOT_RUN)]
    assert not unaccounted, f"commands neither run by this test nor in NOT_RUN: {unaccounted}"
    assert set(NOT_RUN) <= {longest_key(c, NOT_RUN) for c in commands}, "NOT_RUN names a command the docs lost"


def run_all(commands: list[str], monkeypatch, folder: Path, smaller: bool = False) -> None:
    """Run README commands in `folder` in this process (what `psgd` runs, without an interpreter and
    a torch import per command); the servers and workers they start are real processes."""
    monkeypatch.chdir(folder)  # the README's relative paths (results/...) land in the scratch folder
    if not (folder / "examples").exists():
        (folder / "examples").symlink_to(ROOT / "examples")  # and examples/... is the repository's
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "psgd", command
        key = longest_key(command, BUDGETS) or ""
        r = psgd_main(*argv[1:], *BUDGETS.get(key, []), *(SMALLER if smaller and key in SMALLER_KEYS else []))
        assert r.returncode == 0, f"{command}\n{r.stderr[-2000:]}"
    assert processes_mentioning(str(folder)) == []


def runnable() -> list[str]:
    return [c for c in docs_commands() if not longest_key(c, NOT_RUN)]


@pytest.mark.usefixtures("warm_runs")
def test_the_start_here_path_works_and_leaves_its_figures(tmp_path, monkeypatch):
    walk = [c for c in runnable() if c.startswith(WALK)]
    assert [c.split()[1] for c in walk] == ["run", "run", "plot", "plot", "trace"], walk
    run_all(walk, monkeypatch, tmp_path)
    for path in ("results/runs/sync/summary.json", "results/runs/async/summary.json", "results/runs/first.png",
                 "results/runs/first-time.png", "results/runs/async/trace.png"):
        assert (tmp_path / path).is_file(), path
    # Only under the paths .gitignore ignores: a reader's `git status` stays clean (issue 33).
    written = [p.relative_to(tmp_path).as_posix() for p in (tmp_path / "results").rglob("*") if p.is_file()]
    assert written and all(w.startswith(("results/runs/", "results/tmp/")) for w in written), written
    # The trace of a real run: every worker's first steps, each segment in order, none before the start.
    rows = list(csv.DictReader(open(tmp_path / "results/runs/async/trace.csv", newline="")))
    assert {(r["rank"], r["clock"]) for r in rows} >= {(str(k), "0") for k in range(4)}
    assert all(float(r["start_s"]) <= float(r["end_s"]) for r in rows)
    # The tolerance is for mixing time.time() ends with perf_counter() durations, not slack in the rule.
    assert all(float(r["start_s"]) >= -1e-3 for r in rows)


@pytest.mark.usefixtures("warm_runs")
def test_the_other_readme_commands_work_as_written(tmp_path, monkeypatch):
    rest = [c for c in runnable() if not c.startswith(WALK)]
    assert any(c.startswith("psgd run --mode allreduce") for c in rest)
    assert any(c.startswith("psgd model") for c in rest)
    run_all(rest, monkeypatch, tmp_path, smaller=True)
    # Only under the paths .gitignore ignores: `psgd model` as docs/measure.md shows it rewrote the
    # committed results/model/ (issue 54, item 7).
    written = [p.relative_to(tmp_path).as_posix() for p in (tmp_path / "results").rglob("*") if p.is_file()]
    assert "results/tmp/model/model.png" in written, written
    assert all(w.startswith(("results/runs/", "results/tmp/")) for w in written), written
    # "Train your own model": config.json records the spec and the sha256 of the file it names.
    sources = json.loads((tmp_path / "results/runs/yours/config.json").read_text())["sources"]
    plain = ROOT / "examples" / "08_your_model.py"
    assert sources["--model"] == {"spec": "examples/08_your_model.py:make_model", "file": str(plain),
                                  "sha256": hashlib.sha256(plain.read_bytes()).hexdigest()}
    assert sources["--dataset"]["spec"] == "examples/08_your_model.py:make_data"
