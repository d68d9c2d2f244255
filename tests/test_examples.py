"""The teaching examples run as written (04 and 05 start many processes and are covered by test_run /
test_collective)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ENV

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name,expect", [
    ("01_single.py", "test accuracy"),
    ("02_sync_ps_in_process.py", "version 200"),
    ("03_consistency_policies.py", "max clock gap 1 (bound 1)"),
])
def test_example_runs(name, expect):
    r = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr
    assert expect in r.stdout
