"""Every teaching example runs as written and checks its own claim (each ends in assertions:
01 learns, 02 equals 01's parameters, 03 keeps the SSP bound, 04 shows who waits for the
straggler, 05's ring equals the library's all-reduce)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ENV, processes_mentioning

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(n for n, _ in CASES)


CASES = [
    ("01_one_process.py", "test accuracy"),
    ("04_threads_equal_torch.py", "largest difference from 01_one_process.py's parameters"),
    ("02_consistency_policies.py", "max clock gap 1 (bound 1)"),
    ("05_processes_straggler.py", "ssp  :"),
    ("06_allreduce.py", "largest difference library vs ring"),
]


@pytest.mark.parametrize("name,expect", CASES)
def test_example_runs_and_holds_its_claim(name, expect, tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=300, env=ENV,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert expect in r.stdout
    assert processes_mentioning(str(tmp_path)) == []
