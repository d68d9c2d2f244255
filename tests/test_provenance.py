"""The run cache's key (psgd/lab/provenance.py): the last commit that changed what the training code
does. A commit that only rewords comments and docstrings keeps the key, so the committed runs stay
current; any other change to the run paths moves it."""

import os
import subprocess
from pathlib import Path

from psgd.lab import provenance

CODE = '"""A module."""\n\n\ndef f(x):\n    """Double it."""\n    return 2 * x  # why: twice\n'


def test_same_code_sees_through_comments_and_docstrings_only():
    reworded = CODE.replace("A module.", "A module, reworded.").replace("Double it.", "Twice x.")
    reworded = reworded.replace("# why: twice", "# a comment\n# of two lines")
    assert provenance.same_code("m.py", CODE, reworded)
    assert not provenance.same_code("m.py", CODE, CODE.replace("2 * x", "3 * x"))
    # A docstring that becomes a statement is a change of code.
    assert not provenance.same_code("m.py", CODE, CODE.replace('"""Double it."""', "x = x"))
    # A string that is not a docstring is code; so is any change outside Python, and a new file.
    assert not provenance.same_code("m.py", "x = 1\ns = 'a'\n", "x = 1\ns = 'b'\n")
    assert not provenance.same_code("m.proto", "a", "a // b")
    assert not provenance.same_code("m.py", None, CODE)
    assert not provenance.same_code("m.py", "def (:\n", "def (:\n")  # unparsable: never the same


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def _commit(repo: Path, path: str, text: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", path)
    return _git(repo, "log", "-1", "--format=%h")


def test_the_run_key_passes_over_commits_of_prose_and_lab_code(tmp_path):
    _git(tmp_path, "init", "-q")
    first = _commit(tmp_path, "psgd/m.py", CODE)
    assert provenance.run_code_version(tmp_path) == first
    _commit(tmp_path, "psgd/m.py", CODE.replace("Double it.", "Twice x."))   # a docstring
    _commit(tmp_path, "psgd/lab/report.py", "x = 1\n")                        # the lab's code
    assert provenance.run_code_version(tmp_path) == first
    assert provenance.code_version(tmp_path) != first                         # the whole code moved
    second = _commit(tmp_path, "psgd/m.py", CODE.replace("2 * x", "3 * x"))
    assert provenance.run_code_version(tmp_path) == second
    # Uncommitted: a reworded comment keeps the key; a change of code names its difference.
    (tmp_path / "psgd/m.py").write_text(CODE.replace("2 * x", "3 * x  # reworded"))
    assert provenance.run_code_version(tmp_path) == second
    (tmp_path / "psgd/m.py").write_text(CODE.replace("2 * x", "4 * x"))
    assert provenance.run_code_version(tmp_path).startswith(f"{second}-dirty-")
    (tmp_path / "psgd/m.py").write_text(CODE.replace("2 * x", "3 * x"))
    # A binary file of the run paths is a change, never read as text.
    third = _commit(tmp_path, "psgd/kernel.bin", "")
    (tmp_path / "psgd/kernel.bin").write_bytes(bytes([0xFF, 0xFE, 0x00, 0x80]))
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "binary")
    fourth = _git(tmp_path, "log", "-1", "--format=%h")
    assert fourth != third and provenance.run_code_version(tmp_path) == fourth
    (tmp_path / "psgd/kernel.bin").write_bytes(bytes([0x80, 0xFF]))
    assert provenance.run_code_version(tmp_path).startswith(f"{fourth}-dirty-")
    (tmp_path / "psgd/kernel.bin").write_bytes(bytes([0xFF, 0xFE, 0x00, 0x80]))
    (tmp_path / "psgd/new.py").write_text('"""Only a docstring, but a new module."""\n')
    assert provenance.run_code_version(tmp_path).startswith(f"{fourth}-dirty-")
