"""Which recorded parameter hashes this machine reproduces: one set per machine class.

A run's last bits follow more than psgd's code. torch's own CPU kernels are pinned to AVX2 for the
tests (conftest.py), but its matrix products go to MKL, which picks its kernels by the CPU's vendor
and instruction set whatever ATEN_CPU_CAPABILITY says. Measured on 2026-12-02, the same six-step sync
case of test_kernel_hashes: 0bc368ea... on AMD EPYC, 6acb22d9... on an Intel Xeon with AVX-512; and
MKL_CBWR's branches give that Intel machine four values more, none of them AMD's. So a test that
holds a hash holds one per machine class it was recorded on, and the class is named from
/proc/cpuinfo and the environment that steers MKL (a set MKL_CBWR makes another class).

On a class with nothing recorded (a laptop, another vendor) a hash cannot be checked against
anything: `recorded` warns, naming the class and what this machine gave, and returns None; the
kernel cases then hold that a second run gives the same bits, and the run tests what they hold
besides the hash. The strict check runs on the recorded classes, the CI's and the lab's.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

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
    first = cpuinfo.split("\n\n", 1)[0]  # the first processor's block
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    vendor = fields.get("vendor_id", "unknown vendor")
    name = vendor
    if vendor == "GenuineIntel":
        name += " avx512f" if "avx512f" in fields.get("flags", "").split() else " no avx512f"
    steered = [f"{k}={env.get(k, '')}" for k, ours in OURS.items() if env.get(k, '') != ours]
    return " ".join([name, *steered])


class UnrecordedMachine(UserWarning):
    """This machine's class has no recorded parameter hash: the value is not checked."""


def recorded(table: dict, got=None):
    """`table[machine()]`, or None (with a warning saying what this machine gave) where this
    class has nothing recorded."""
    here = machine()
    if here not in table:
        warnings.warn(UnrecordedMachine(
            f"no parameter hash is recorded for this machine class ({here!r}; recorded: {sorted(table)}): "
            f"MKL's kernels, and with them a run's last bits, differ by CPU. This machine gives {got!r}"), stacklevel=2)
        return None
    return table[here]
