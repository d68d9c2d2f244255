"""`psgd doctor`: on a CPU-only host --gpu checks nothing, says so and exits 0; the loss comparison it uses on a GPU
host; pytest's outcomes read back. The GPU steps themselves run in `make gpu-check` on a GPU host."""

from __future__ import annotations

import pytest
import torch

from psgd.lab import doctor
from tests.helpers import psgd_main


def test_gpu_check_without_a_gpu_checks_nothing_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # whatever this machine has
    out = tmp_path / "gpu"
    r = psgd_main("doctor", "--gpu", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU here" in r.stdout and "checked nothing, wrote nothing" in r.stdout
    assert not out.exists()
    assert psgd_main("doctor", "--budget-s", "0").returncode == 2


def test_losses_compare_within_the_tolerance_only():
    cpu = {(r, c): 2.3 - 0.01 * c for r in (0, 1) for c in range(40)}
    assert doctor.compare_losses(cpu, dict(cpu))["max_abs_diff"] == 0.0
    rounding = {k: v * (1 + 1e-6) for k, v in cpu.items()}   # fp32 rounding of other kernels: passes
    assert doctor.compare_losses(cpu, rounding)["max_rel_diff"] == pytest.approx(1e-6)
    stale = {**cpu, (1, 7): cpu[(1, 7)] * (1 + 3e-3)}   # one update's effect on one step: fails
    with pytest.raises(doctor.CheckFailed, match="worker 1 step 7: loss"):
        doctor.compare_losses(cpu, stale)
    with pytest.raises(doctor.CheckFailed, match="different steps"):
        doctor.compare_losses(cpu, {k: v for k, v in cpu.items() if k != (0, 39)})


def test_test_outcomes_are_read_from_junit_xml(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_gpu" name="test_a"/>'
                   '<testcase classname="tests.test_gpu" name="test_b"><skipped message="needs 2 CUDA device(s)"/>'
                   '</testcase><testcase classname="tests.test_gpu" name="test_c"><failure message="boom"/></testcase>'
                   '</testsuite></testsuites>')
    assert doctor.junit_outcomes(xml) == {"test_gpu::test_a": "passed",
                                          "test_gpu::test_b": "skipped: needs 2 CUDA device(s)",
                                          "test_gpu::test_c": "failure: boom"}
