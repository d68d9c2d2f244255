"""Today's parameter hashes, held before the kernel's redesign (a change of form, not of results).

Each case drives the production shard core (psgd/ps/shard.py with its policy and fused SGD) in one
thread, the workers taken in a fixed order at every clock, so the arrival order, and with it every
bit of the parameters, is the same on every run and every machine of a class with the same torch build
(tests/numerics.py: MKL's kernels differ by CPU, so the hashes are held per class). The
hashes were recorded at commit 828a0ea, before the rules moved into psgd/core/rules.py: a refactor
that changes any of them changed a result, not only the form.

- sync, 3 workers; async, 3 workers (stale by construction: worker w computes on the version after
  worker w-1's update); SSP(1), 3 workers, worker 0 a clock behind (the bound's edge, never past it);
- sync with one backup worker (the late gradient of every step dropped);
- elastic sync: 2 of 3 slots at the start, slot 2 admitted at step 3 (the quorum grows at that boundary);
- and one real `psgd run` (3 workers, 2 gRPC shards, sync), whose summary's params_sha256 covers the
  whole path: launcher, zygote, transport, client, shard, policy, optimizer.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from psgd.core.config import OptimConfig, RunConfig
from psgd.train import assemble
from tests import numerics
from tests.helpers import open_start_barrier, psgd_main, summary

STEPS = 6


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def drive(cfg: RunConfig, order) -> tuple[str, int, dict]:
    """Run `order` (groups of (worker, clock)) against a fresh production shard core; return the
    hash of its parameters, its version and its staleness histogram."""
    torch.manual_seed(0)
    model = torch.nn.Linear(15, 4)  # 64 parameters: the fused kernel's vector loop only
    target = torch.randn(4, 15)
    xs = torch.randn(cfg.workers, STEPS + 4, 8, 15)
    shard = assemble.shard(cfg, 0)
    shard.init(torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone())
    open_start_barrier(shard, cfg.members)  # a scheduled joiner never pulls at the start barrier
    for group in order:  # every worker of a group pulls, then each pushes, in the group's order
        pulled = []
        for w, clock in group:
            with shard.pull(w, 0, clock, "fp32", timeout=30) as p:
                if not p.done:  # done: the budget is spent (backup: the last step's late worker)
                    pulled.append((w, clock, p.version, p.values.clone()))
        for w, clock, version, params in pulled:
            torch.nn.utils.vector_to_parameters(params, model.parameters())
            model.zero_grad(set_to_none=True)
            x = xs[w, clock]
            torch.nn.functional.mse_loss(model(x), x @ target.T).backward()
            grad = torch.nn.utils.parameters_to_vector([q.grad for q in model.parameters()])
            out = shard.push(w, clock, version, grad, "fp32")
            assert not out.refused or shard.policy.done, (w, clock)  # refused only past the budget
    return digest(shard.param), shard.policy.version, dict(shard.policy.stats.staleness)


def cfg(mode: str, **kw) -> RunConfig:
    return RunConfig(mode=mode, workers=3, servers=1, steps=STEPS, device="cpu",
                     optim=OptimConfig(lr=0.1, momentum=0.9), **kw)


def lockstep(workers=(0, 1, 2)):
    return [[(w, c) for w in workers] for c in range(STEPS)]


# The parameter hash of each case. Recorded at 828a0ea (the kernel before psgd/core/rules.py), on torch
# 2.13.0+cpu, AMD EPYC; the same code's values on an Intel Xeon with AVX-512 recorded with training code
# fe4506d (MKL picks other kernels: tests/numerics.py).
HASHES = {
    numerics.AMD: {"sync": "0bc368ea4d7b4730", "async": "275db4f95327b810", "ssp": "ed4d0c15c955f8d7",
                   "backup": "6c5914bf741d127b", "elastic": "8a927e55e498759d"},
    numerics.INTEL_AVX512: {"sync": "6acb22d900004e76", "async": "04cd1d7c9252c0cf", "ssp": "73c9f8dd5bbef438",
                            "backup": "d5174c1b141ba5e8", "elastic": "959b4fa21e6945b1"},
}
# Each case's version and staleness counts: the rules' own, on every CPU.
COUNTS = {
    "sync": (6, {0: 18}),
    "async": (18, {0: 6, 1: 6, 2: 6}),
    "ssp": (18, {0: 7, 1: 6, 2: 5}),
    "backup": (6, {0: 12}),
    "elastic": (6, {0: 15}),
}
# `psgd run --mode sync --workers 3 --servers 2 --steps 40 --eval-every 20`'s params_sha256[:16].
RUN = {numerics.AMD: "e3b168455e7a60b9", numerics.INTEL_AVX512: "77af529c4583ba1b"}


def ssp_order() -> list[list[tuple[int, int]]]:
    # Workers 1 and 2 run one clock ahead of worker 0 (SSP(1)'s edge): 1, 2 at c+1 beside 0 at c.
    return [[(1, 0), (2, 0)]] + [[(0, c)] + ([(1, c + 1), (2, c + 1)] if c + 1 < STEPS else [])
                                 for c in range(STEPS)]


def elastic_order() -> list[list[tuple[int, int]]]:
    return [[(w, c) for w in ((0, 1) if c < 3 else (0, 1, 2))] for c in range(STEPS)]


CASES = {
    "sync": lambda: drive(cfg("sync"), lockstep()),
    "async": lambda: drive(cfg("async"), lockstep()),
    "ssp": lambda: drive(cfg("ssp", staleness=1), ssp_order()),
    "backup": lambda: drive(cfg("sync", backup_workers=1), lockstep()),
    "elastic": lambda: drive(cfg("sync", elastic="0:2,3:3"), elastic_order()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kernel_gives_todays_parameters_bit_for_bit(case):
    got = CASES[case]()
    hashes = numerics.recorded(HASHES, got)
    # Where this class has nothing recorded: the same bits again, at least (tests/numerics.py).
    assert got == ((hashes[case], *COUNTS[case]) if hashes is not None else CASES[case]()), f"{case}: {got}"


@pytest.mark.usefixtures("warm_runs")
def test_a_sync_run_gives_todays_parameter_hash(tmp_path):
    out = tmp_path / "sync"
    r = psgd_main("run", "--mode", "sync", "--workers", "3", "--servers", "2", "--steps", "40", "--eval-every", "20",
                  "--out", str(out))
    assert r.returncode == 0, r.stderr
    got = summary(out)["params_sha256"][:16]
    assert got == (numerics.recorded(RUN, got) or got)  # unrecorded class: warned, not checked


def test_the_machine_class_is_the_cpu_vendor_its_vector_width_and_what_steers_mkl():
    amd = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f\n"
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f avx512_fp16\n"
    ours = {"ATEN_CPU_CAPABILITY": "avx2"}
    assert numerics.machine(amd, ours) == numerics.AMD
    assert numerics.machine(intel, ours) == numerics.INTEL_AVX512
    assert numerics.machine(intel.replace(" avx512f avx512_fp16", ""), ours) == "GenuineIntel no avx512f"
    # MKL_CBWR picks other kernels (measured: four more hashes on one Intel machine): another class.
    assert numerics.machine(intel, dict(ours, MKL_CBWR="AVX2")) == "GenuineIntel avx512f MKL_CBWR=AVX2"
    assert numerics.machine(amd, {}) == "AuthenticAMD ATEN_CPU_CAPABILITY="


def test_an_unrecorded_machine_class_is_warned_of_and_its_value_named(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AVX2")  # a class of its own, recorded nowhere
    with pytest.warns(numerics.UnrecordedMachine, match=r"MKL_CBWR=AVX2.*This machine gives 'abc'"):
        assert numerics.recorded({numerics.AMD: "x"}, "abc") is None
    monkeypatch.delenv("MKL_CBWR")
    assert numerics.recorded({numerics.machine(): "x"}, "abc") == "x"  # a recorded class: its value


# Every transport carries the same bits (recorded at 8f63c21 on the AMD EPYC, and at 250af7f on the
# Intel Xeon, before issue 53 moved the transports into rooms and made shm the one-host default):
# sync's sum is in worker order, and one async worker's arrival order is its own, so both hash alike
# on every wire. The shm cases take the homed one-shard path and the two-shard segment path; the
# default (auto) takes shm on this host, so its cases hash as shm's.
TRANSPORT_RUNS = {
    "sync-tcp": (("--mode", "sync", "--workers", "3", "--servers", "2", "--eval-every", "20", "--transport", "tcp"),
                 RUN),
    "sync-shm": (("--mode", "sync", "--workers", "3", "--servers", "2", "--eval-every", "20", "--transport", "shm"),
                 RUN),
    "async1-tcp": (("--mode", "async", "--workers", "1", "--servers", "2", "--eval-every", "0", "--transport", "tcp"),
                   ASYNC1_TCP := {numerics.AMD: "2096290efa090a91", numerics.INTEL_AVX512: "8b4bcc5d1c3ac9ab"}),
    "async1-shm-homed": (("--mode", "async", "--workers", "1", "--servers", "1", "--eval-every", "0",
                          "--transport", "shm"),
                         ASYNC1_HOMED := {numerics.AMD: "0b19bdcd01ba68d6", numerics.INTEL_AVX512: "8bc377b5e853a820"}),
    "async1-default": (("--mode", "async", "--workers", "1", "--servers", "1", "--eval-every", "0"), ASYNC1_HOMED),
    "async1-default-2": (("--mode", "async", "--workers", "1", "--servers", "2", "--eval-every", "0"), ASYNC1_TCP),
}


@pytest.mark.usefixtures("warm_runs")
@pytest.mark.parametrize("case", sorted(TRANSPORT_RUNS))
def test_every_transport_gives_todays_parameter_hash(tmp_path, case):
    flags, table = TRANSPORT_RUNS[case]
    out = tmp_path / case
    r = psgd_main("run", *flags, "--steps", "40", "--out", str(out))
    assert r.returncode == 0, r.stderr
    got = summary(out)["params_sha256"][:16]
    assert got == (numerics.recorded(table, got) or got), case
