"""The outputs README.md and docs/tutorial.md show are the code's (psgd/lab/docs_outputs.py, issue 33).

tests/test_examples.py runs every example once and checks the shown outputs of that command; this
file runs the marked commands it does not (examples/02 with one policy at a time), checks that
every marked command is run by one of the two, runs examples/10 twice (its accuracy is the same
every run), and checks the mechanism itself on documents of its own.
"""

from __future__ import annotations

import re

import pytest

from psgd.lab import docs_outputs
from tests.helpers import ENV, processes_in_session, processes_with_env
from tests.test_examples import CASES
from tests.warm import run_script

BY_EXAMPLES_TEST = {" ".join(["python", f"examples/{name}", *args]) for name, args, _ in CASES}
HERE = [c for c in docs_outputs.commands() if c not in BY_EXAMPLES_TEST]


def run(command: str, tmp_path, parent) -> str:
    """docs_outputs.run, each `python examples/...` forked from the warm parent (tests/warm.py
    `script_parent`: no interpreter start and torch import per command); nothing may be left behind."""
    marker = f"psgd-docs-outputs-{tmp_path}"
    pids = []

    def forked(argv, env, cwd, timeout):
        r, pid = run_script(parent, argv, env, cwd, timeout)
        pids.append(pid)
        return r

    out = docs_outputs.run(command, env=dict(ENV, TMPDIR=str(tmp_path), PSGD_EXAMPLE_TEST=marker), cwd=tmp_path,
                           runner=forked)
    left = processes_with_env("PSGD_EXAMPLE_TEST", marker) + [p for pid in pids for p in processes_in_session(pid)]
    assert left == [], f"{command} left processes behind: {left}"
    return out


def test_every_shown_output_is_checked():
    commands = docs_outputs.commands()
    assert len(docs_outputs.blocks()) >= 12 and len(commands) >= 10, "the documents lost their output markers"
    assert all(docs_outputs.example_of(c) for c in commands)
    assert set(commands) <= BY_EXAMPLES_TEST | set(HERE)
    assert set(docs_outputs.VARIES) <= {docs_outputs.example_of(c) for c in commands}


@pytest.mark.parametrize("command", HERE)
def test_the_shown_output_is_what_the_code_prints(command, tmp_path, script_parent):
    assert docs_outputs.differences({command: run(command, tmp_path, script_parent)}) == []


def test_example_10_gives_the_same_accuracy_every_run(tmp_path, script_parent):
    """Both worker threads start from the same parameters (copies of the first model), and sync sums
    a step's gradients in worker order: the run is the same computation every time."""
    command = "python examples/10_your_loop_psgd.py"
    first, second = run(command, tmp_path, script_parent), run(command, tmp_path, script_parent)
    accuracy = re.compile(r"test loss .* test accuracy .*")
    assert accuracy.search(first) and accuracy.search(first).group(0) == accuracy.search(second).group(0)
    assert docs_outputs.differences({command: second}) == []  # and it is what README.md and the tutorial show


def docs(tmp_path, tutorial: str, readme: str = "") -> None:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "tutorial.md").write_text(tutorial)
    (tmp_path / "README.md").write_text(readme)


def test_a_stale_block_is_found_and_rewritten_and_what_varies_is_masked(tmp_path):
    block = ("intro\n<!-- output: python examples/05_processes_straggler.py | tail -2 -->\n```text\n"
             "baseline              5.6                0.0     20,   20          {acc}  sha256 f77d916da978\n"
             "straggler            49.2               40.7     20,   20          {acc}  sha256 f77d916da978\n"
             "```\n<!-- /output -->\nafter\n")
    docs(tmp_path, block.format(acc="0.270"))
    printed = ("head line\n"
               "baseline              2.9                0.4     20,   20          0.265  sha256 e71eb03abb56\n"
               "straggler            44.3               41.7     20,   20          0.265  sha256 e71eb03abb56\n")
    outputs = {"python examples/05_processes_straggler.py": printed}
    problems = docs_outputs.differences(outputs, tmp_path)
    assert len(problems) == 1 and "0.270" in problems[0] and "0.265" in problems[0]
    assert docs_outputs.write(outputs, tmp_path) == ["docs/tutorial.md"]
    text = (tmp_path / "docs" / "tutorial.md").read_text()
    assert text == "intro\n<!-- output: python examples/05_processes_straggler.py | tail -2 -->\n```text\n" \
        + printed.split("\n", 1)[1] + "```\n<!-- /output -->\nafter\n"
    assert docs_outputs.differences(outputs, tmp_path) == []
    # Only the milliseconds and the hash (it follows the CPU's kernels) differ: the block agrees,
    # and --write leaves it as it is.
    docs(tmp_path, block.format(acc="0.265"))
    assert docs_outputs.differences(outputs, tmp_path) == [] and docs_outputs.write(outputs, tmp_path) == []


def test_a_quoted_value_is_checked_and_rewritten(tmp_path):
    readme = "python examples/10_your_loop_psgd.py        # your loop kept: 2 worker threads pull and push: -> 0.850\n"
    docs(tmp_path, "", readme)
    outputs = {"python examples/10_your_loop_psgd.py": "test loss 1.1072 -> 0.3737, test accuracy 0.325 -> 0.875\n"}
    assert docs_outputs.differences(outputs, tmp_path) == [
        "README.md shows '0.850' where `python examples/10_your_loop_psgd.py` prints '0.875'"]
    assert docs_outputs.write(outputs, tmp_path) == ["README.md"]
    assert (tmp_path / "README.md").read_text() == readme.replace("0.850", "0.875")
    assert docs_outputs.differences(outputs, tmp_path) == []
