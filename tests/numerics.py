"""Which recorded parameter hashes this machine reproduces: one set per machine class.

A run's last bits follow more than psgd's code. torch's own CPU kernels are pinned to AVX2 for the
tests (conftest.py), but its matrix products go to MKL, which picks its kernels by the CPU's vendor
and instruction set whatever ATEN_CPU_CAPABILITY says. Measured on 2026-12-02, the same six-step sync
case of test_kernel_hashes: 0bc368ea... on AMD EPYC, 6acb22d9... on an Intel Xeon with AVX-512; and
MKL_CBWR's branches give that Intel machine four values more, none of them AMD's. So a test that
holds a hash holds one per machine class it was recorded on, and the class is named from
/proc/cpuinfo and the environment that steers MKL (a set MKL_CBWR makes another class).

On a class with nothing recorded the test fails, saying so and printing what this machine gives:
a hash is a regression check only against a value recorded on the same class of machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The classes the tests' hashes were recorded on (the CI and development machines of this project).
AMD = "AuthenticAMD"
INTEL_AVX512 = "GenuineIntel avx512f"
# What steers the kernels, at the tests' own values (conftest.py pins ATen to AVX2; MKL is left to pick).
OURS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "", "MKL_ENABLE_INSTRUCTIONS": ""}


def machine(cpuinfo: str | None = None, env: dict | None = None) -> str:
    """This machine's class: the CPU vendor, for Intel whether it has AVX-512 (MKL's widest path),
    and any MKL or ATen setting that differs from the tests' own."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    env = os.environ if env is None else env
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines()[:40] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    vendor = fields.get("vendor_id", "unknown vendor")
    name = vendor
    if vendor == "GenuineIntel":
        name += " avx512f" if "avx512f" in fields.get("flags", "").split() else " no avx512f"
    steered = [f"{k}={env.get(k, '')}" for k, ours in OURS.items() if env.get(k, '') != ours]
    return " ".join([name, *steered])


def recorded(table: dict, got=None):
    """`table[machine()]`; where this class has nothing recorded, fail saying so (and what `got`,
    this machine's value, would be to record)."""
    here = machine()
    if here not in table:
        pytest.fail(f"no parameter hash is recorded for this machine class ({here!r}; recorded: "
                    f"{sorted(table)}): MKL's kernels, and with them a run's last bits, differ by CPU. "
                    f"This machine gives {got!r}; record it in the test's table once a run of the same "
                    "code on a recorded class has passed", pytrace=False)
    return table[here]
