"""The guided lab (examples/, docs/tutorial.md, issue 11): every example runs as written and checks
its own claims (each ends in assertions, so exit 0 means they held), leaves no process behind, and
every command the tutorial shows names an example that exists, with flags that example has.
08-10 (issue 23) are one file three times: plain torch, then psgd.fit, then the user's own loop
with pull / push; the diffs between them stay a few lines, and README.md shows them."""

import ast
import difflib
import json
import re
import subprocess
from pathlib import Path

import pytest

from psgd.lab import docs_outputs
from tests import numerics
from tests.helpers import ENV, processes_in_session, processes_with_env
from tests.test_readme import readme_commands
from tests.warm import run_script

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TUTORIAL = ROOT / "docs" / "tutorial.md"

# (example, arguments, lines its output must contain). 02 plays its three policies in one process
# (--policy all): the same code as one --policy at a time, one torch import instead of three.
CASES = [
    ("01_one_process.py", [], ["final parameters: 22026 numbers, norm"]),
    ("02_consistency_policies.py", ["--policy", "all", "--staleness", "1"],
     ["checked: sync kept its rule", "checked: async kept its rule", "checked: ssp(staleness=1) kept its rule"]),
    ("03_push_pull_by_hand.py", [], ["shard stats: version 2"]),
    ("04_threads_equal_torch.py", [], ["4 worker(s) x 16"]),
    ("05_processes_straggler.py", [], ["sync: the straggler costs every update"]),
    ("06_allreduce.py", [], ["whole numbers"]),
    ("07_async_staleness.py", [], ["checked: every gradient counted"]),
    ("08_your_model.py", [], ["one process, 5 epochs of batch 32, AdamW lr 0.01"]),
    ("09_your_model_psgd_fit.py", [], ["psgd.fit: 100 sync updates of 2 workers x 16"]),
    ("10_your_loop_psgd.py", [], ["your loop: 2 worker threads x batch 16, 2 shards, 5 epochs"]),
    ("11_why_parameter_servers.py", [], ["checked: by row the PS moves under a tenth of all-reduce's bytes"]),
]

# Run as a reader runs them, without the tests' ATEN_CPU_CAPABILITY (conftest.py): 05 shows a
# parameter hash, and pins torch's kernels itself, as the suite does (issue 54, item 19), so a
# reader's AVX-512 machine prints the hash of its class (tests/numerics.py) that docs/tutorial.md shows.
AS_A_READER = {"05_processes_straggler.py": {numerics.INTEL_AVX512: "4b2033457a01", numerics.AMD: "e71eb03abb56"}}


def run_example(name: str, args: list[str], tmp_path: Path, parent) -> subprocess.CompletedProcess:
    """Run one example from a scratch folder, as `python examples/NAME ARGS` (forked from the warm
    parent `parent`, tests/warm.py `script_parent`: torch is imported once, not once per example); its
    temporary files and its children's run folders go under tmp_path, and every process it starts
    inherits a marker that the orphan check looks for, or stays in its session."""
    marker = f"psgd-example-{tmp_path}"  # the full path: unique across pytest-xdist workers
    env = dict(ENV, TMPDIR=str(tmp_path), PSGD_EXAMPLE_TEST=marker)
    if name in AS_A_READER:
        env.pop("ATEN_CPU_CAPABILITY", None)
    r, pid = run_script(parent, [EXAMPLES / name, *args], env, tmp_path, timeout=300)
    left = processes_with_env("PSGD_EXAMPLE_TEST", marker) + processes_in_session(pid)
    assert left == [], f"{name} left processes behind: {left}"
    return r


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted({name for name, _, _ in CASES})


@pytest.mark.parametrize("name,args,expect", CASES, ids=[" ".join([n, *a]) for n, a, _ in CASES])
def test_example_runs_and_holds_its_claims(name, args, expect, tmp_path, script_parent):
    r = run_example(name, args, tmp_path, script_parent)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for line in expect:
        assert line in r.stdout, r.stdout[-2000:]
    # What README.md and docs/tutorial.md show of this command is what it printed (psgd/lab/docs_outputs.py).
    assert docs_outputs.differences({" ".join(["python", f"examples/{name}", *args]): r.stdout}) == []
    if name in AS_A_READER:
        got = re.findall(r"sha256 ([0-9a-f]{12})", r.stdout)[-1]
        assert got == (numerics.recorded(AS_A_READER[name], got) or got)  # unrecorded class: warned, not checked


def test_staleness_example_reads_a_runs_summary(tmp_path, script_parent):
    """07 --run DIR draws the histogram summary.json holds (the fields psgd/train/metrics.py writes)."""
    run = tmp_path / "run"
    run.mkdir()
    hist = {"mean": 1.0, "p50": 1.0, "p99": 3.0, "max": 3, "hist": {"0": 2, "1": 3, "3": 1}}
    summary = {"mode": "async", "workers": 2, "servers": 2, "worker_steps": 3, "staleness": hist}
    (run / "summary.json").write_text(json.dumps(summary))
    r = run_example("07_async_staleness.py", ["--run", str(run)], tmp_path, script_parent)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mode async, 2 workers, 2 shard(s), 3 gradients" in r.stdout
    assert "mean 1.0, p99 3, max 3" in r.stdout


def tutorial_commands() -> list[str]:
    """Every line of a ```bash block in docs/tutorial.md that runs an example."""
    blocks = re.findall(r"```bash\n(.*?)```", TUTORIAL.read_text(), flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("python examples/")]


def test_tutorial_commands_name_examples_that_exist():
    commands = tutorial_commands()
    shown = set()
    for command in commands:
        words = command.split("#")[0].split()
        path = ROOT / words[1]
        assert path.parent == EXAMPLES and path.is_file(), f"docs/tutorial.md runs a missing example: {command}"
        source = path.read_text()
        for flag in (w.split("=")[0] for w in words[2:] if w.startswith("--")):
            assert f'"{flag}"' in source, f"docs/tutorial.md passes {flag}, unknown to {path.name}: {command}"
        shown.add(path.name)
    assert shown == {p.name for p in EXAMPLES.glob("*.py")}, "the tutorial runs every example"


# -- 08 -> 09 and 08 -> 10: the same file, a few lines changed ----------------------------------------
PLAIN = "08_your_model.py"
# The most lines each may add and remove against 08: non-blank lines after the module docstring
# (what `diff` shows, less the docstring, which says what each step is, and blank lines).
DIFFS = {"09_your_model_psgd_fit.py": (7, 10), "10_your_loop_psgd.py": (23, 9)}


def code_of(name: str) -> list[str]:
    """An example's lines after its module docstring."""
    source = (EXAMPLES / name).read_text()
    tree = ast.parse(source)
    assert isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant), name
    return source.splitlines()[tree.body[0].end_lineno:]


@pytest.mark.parametrize("name", sorted(DIFFS))
def test_psgd_is_a_few_lines_from_the_plain_loop(name):
    plain, changed = code_of(PLAIN), code_of(name)
    diff = [line for line in difflib.unified_diff(plain, changed, lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---")) and line[1:].strip()]
    added, removed = sum(line[0] == "+" for line in diff), sum(line[0] == "-" for line in diff)
    most_added, most_removed = DIFFS[name]
    assert added <= most_added and removed <= most_removed, f"+{added} -{removed}:\n" + "\n".join(diff)


def test_the_model_and_the_data_are_the_plain_files_own():
    """Net, make_model, make_data and evaluate are 08's, character for character, in 09 and 10;
    psgd imports them from the file by name, so the scripts' own work is under __main__."""
    def definitions(name):
        source = (EXAMPLES / name).read_text()
        tree = ast.parse(source)
        top = {n.name: ast.get_source_segment(source, n) for n in tree.body
               if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert isinstance(tree.body[-1], ast.If) and "__main__" in ast.unparse(tree.body[-1].test), name
        return {k: top[k] for k in ("Net", "make_model", "make_data", "evaluate")}

    assert definitions(PLAIN) == definitions("09_your_model_psgd_fit.py") == definitions("10_your_loop_psgd.py")
    assert "import psgd" not in (EXAMPLES / PLAIN).read_text()


def test_the_readme_runs_examples_as_this_file_does():
    """README's `python examples/...` commands are in NOT_RUN there because these tests run them:
    each must be a case here, with the same arguments."""
    shown = [c.split()[1:] for c in readme_commands((ROOT / "README.md").read_text()) if c.startswith("python ")]
    assert shown, "README.md runs no example"
    cases = {(f"examples/{name}", *args) for name, args, _ in CASES}
    assert all(tuple(words) in cases for words in shown), shown
