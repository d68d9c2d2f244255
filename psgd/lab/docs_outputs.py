"""The outputs README.md and docs/tutorial.md show are the outputs the code prints (issue 33).

Two kinds of shown output, both made by running the code:

- Blocks. A ```text block between the lines `<!-- output: COMMAND -->` and `<!-- /output -->` is
  COMMAND's standard output (`COMMAND | tail -N`: its last N lines). COMMAND is `python
  examples/NAME.py [ARGS]`, run from the repository root.
- Values. A number quoted in prose or in a command's comment, where no marker fits: VALUES names
  the text around it in the document and the line of the command's output it comes from.

What varies from run to run (milliseconds, ports, run folders) or from machine to machine (a
parameter hash, a last-bit difference: MKL picks its kernels by CPU, tests/numerics.py) is listed per
example in VARIES: `--write` keeps the fresh run's, the check masks it on both sides and compares
the rest exactly. Where a masked value carries a claim (05's two runs end with one hash), the
example asserts it itself.
The examples run with one torch thread (OMP_NUM_THREADS=1, as the tests run them): the last bits
of a float sum depend on how many threads add it.

    python -m psgd.lab.docs_outputs            # check: rerun, compare, exit 1 naming each difference
    python -m psgd.lab.docs_outputs --write    # rerun and rewrite the marked outputs
    python -m psgd.lab.docs_outputs --only 05  # only the commands naming this example

tests/test_examples.py checks the blocks of every example it runs; tests/test_docs_outputs.py the rest.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/tutorial.md")
BLOCK = re.compile(r"(?m)^<!-- output: (?P<command>[^\n]+?) -->\n```text\n(?P<body>.*?)```\n<!-- /output -->", re.S)
MASK = "~"

# Per example: what may differ between two runs (each match is masked before comparing).
VARIES = {
    "03_push_pull_by_hand.py": [r"127\.0\.0\.1:\d+"],
    "04_threads_equal_torch.py": [r"difference [1-9]\.\de-\d\d"],  # by machine; 0.0e+00 (bit-equal) by none
    "05_processes_straggler.py": [r"(?m)^(?:baseline|straggler) +[\d.]+ +[\d.]+", r"costs every update \d+ ms",
                                  r"sha256 [0-9a-f]{12}"],
    "09_your_model_psgd_fit.py": [r"[\d.]+ s after [\d.]+ s of start-up, \S+"],
}


@dataclass(frozen=True)
class Value:
    """A number shown in `doc`: group 1 of `shown` (a regex of the document) is group 1 of `printed`
    (a regex of `command`'s output)."""
    doc: str
    shown: str
    command: str
    printed: str


VALUES = [
    Value("README.md", r"python examples/08_your_model.py +# plain torch: test accuracy ([\d.]+ -> [\d.]+)",
          "python examples/08_your_model.py", r"test accuracy ([\d.]+ -> [\d.]+)"),
    Value("README.md", r"python examples/09_your_model_psgd_fit.py +# psgd\.fit: .*?: -> ([\d.]+)",
          "python examples/09_your_model_psgd_fit.py", r"test accuracy [\d.]+ -> ([\d.]+)"),
    Value("README.md", r"python examples/10_your_loop_psgd.py +# your loop kept: .*?: -> ([\d.]+)",
          "python examples/10_your_loop_psgd.py", r"test accuracy [\d.]+ -> ([\d.]+)"),
    Value("README.md", r"\(09 prints ([\d.]+)\)",
          "python examples/09_your_model_psgd_fit.py", r"test accuracy [\d.]+ -> ([\d.]+)"),
]


@dataclass(frozen=True)
class Block:
    doc: str
    command: str        # as the marker writes it, `| tail -N` included
    body: str           # the block's text as the document holds it
    span: tuple[int, int]  # of `body` in the document

    @property
    def run(self) -> str:
        """The command that makes it, without the tail."""
        return self.command.split("|")[0].strip()

    def shown(self, stdout: str) -> str:
        """What the block holds for this output: all of it, or its last N lines."""
        m = re.search(r"\|\s*tail -(\d+)\s*$", self.command)
        lines = stdout.rstrip("\n").split("\n")
        return "\n".join(lines[-int(m.group(1)):] if m else lines) + "\n"


def blocks(root: Path = ROOT, docs=DOCS) -> list[Block]:
    found = []
    for doc in docs:
        text = (root / doc).read_text()
        found += [Block(doc, m["command"], m["body"], m.span("body")) for m in BLOCK.finditer(text)]
    return found


def commands(root: Path = ROOT) -> list[str]:
    """Every command whose output the documents show, once each, in order."""
    return list(dict.fromkeys([b.run for b in blocks(root)] + [v.command for v in VALUES]))


def example_of(command: str) -> str:
    words = shlex.split(command)
    if len(words) < 2 or words[0] != "python" or not words[1].startswith("examples/"):
        raise ValueError(f"not a `python examples/NAME.py` command: {command!r}")
    return Path(words[1]).name


def masked(command: str, text: str) -> str:
    for pattern in VARIES.get(example_of(command), []):
        text = re.sub(pattern, MASK, text)
    return text


def python(argv: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python ARGV` in its own interpreter, its output captured as text."""
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def run(command: str, root: Path = ROOT, env: dict | None = None, cwd: Path | None = None, runner=python) -> str:
    """`command`'s standard output; it must exit 0 (an example checks its own claims). `runner(argv,
    env, cwd, timeout)` runs `python ARGV` (the tests': forked from a warm parent, tests/warm.py)."""
    words = shlex.split(command)
    example_of(command)
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        r = runner([str(root / words[1]), *words[2:]], dict(env, TMPDIR=env.get("TMPDIR", tmp)), cwd or Path(tmp), 600)
    if r.returncode != 0:
        raise RuntimeError(f"{command} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r.stdout


def differences(outputs: dict[str, str], root: Path = ROOT) -> list[str]:
    """Each shown output that `outputs` (command -> stdout) contradicts, as one message; commands
    missing from `outputs` are not checked."""
    problems = []
    for b in blocks(root):
        if b.run in outputs:
            want, got = masked(b.run, b.body), masked(b.run, b.shown(outputs[b.run]))
            if want != got:
                problems.append(f"{b.doc}: the output of `{b.command}` differs from what the code prints:\n"
                                + "".join(f"  shown:   {w}\n  printed: {g}\n" for w, g in
                                          zip(want.split("\n"), got.split("\n"), strict=False) if w != g))
    for v in VALUES:
        if v.command not in outputs:
            continue
        text = (root / v.doc).read_text()
        shown, printed = re.search(v.shown, text), re.search(v.printed, outputs[v.command])
        if not shown or not printed:
            problems.append(f"{v.doc}: {'no text matches ' + v.shown if not shown else v.command + ' printed no '}"
                            f"{'' if not shown else v.printed}")
        elif shown.group(1) != printed.group(1):
            problems.append(f"{v.doc} shows {shown.group(1)!r} where `{v.command}` prints {printed.group(1)!r}")
    return problems


def write(outputs: dict[str, str], root: Path = ROOT) -> list[str]:
    """Rewrite every shown output of the commands in `outputs` that differs from the code's (what
    VARIES aside: a block that agrees keeps its times and ports); returns the documents changed."""
    changed = []
    for doc in DOCS:
        path = root / doc
        text = old = path.read_text()
        stale = [b for b in blocks(root, [doc]) if b.run in outputs
                 and masked(b.run, b.body) != masked(b.run, b.shown(outputs[b.run]))]
        for b in sorted(stale, key=lambda b: -b.span[0]):
            text = text[:b.span[0]] + b.shown(outputs[b.run]) + text[b.span[1]:]
        for v in VALUES:
            if v.doc == doc and v.command in outputs:
                printed = re.search(v.printed, outputs[v.command])
                if printed:
                    text = re.sub(v.shown, lambda m, p=printed.group(1): m.group(0)[:m.start(1) - m.start(0)] + p
                                  + m.group(0)[m.end(1) - m.start(0):], text, count=1)
        if text != old:
            path.write_text(text)
            changed.append(doc)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m psgd.lab.docs_outputs", description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the shown outputs from fresh runs")
    p.add_argument("--only", default="", help="only the commands whose example's name contains this")
    a = p.parse_args(argv)
    todo = [c for c in commands() if a.only in example_of(c)]
    outputs = {}
    for command in todo:
        print(f"running {command}", file=sys.stderr)
        outputs[command] = run(command)
    if a.write:
        for doc in write(outputs):
            print(f"{doc}: rewritten")
        return 0
    problems = differences(outputs)
    for problem in problems:
        print(problem)
    print(f"{len(todo)} commands, {f'{len(problems)} differences' if problems else 'the documents agree'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
