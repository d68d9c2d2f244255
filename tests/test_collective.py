"""All-reduce mode: the ring against torch.distributed, replicas against each other, the whole
run against sync PS and a plain torch loop, and failures that end runs instead of hanging them.

Multi-process tests use gloo on 127.0.0.1: torch.multiprocessing.spawn with a file:// rendezvous
in tmp_path, or real `psgd` processes; every one is joined or killed before the test returns.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from psgd import cli
from psgd.allreduce.collective import CollectiveError, CollectiveExchange, CollectiveOptions, Rendezvous, choose_backend
from psgd.allreduce.ring import all_gather_step, reduce_scatter_step, ring_all_reduce, ring_bytes
from psgd.core.config import ModelConfig, OptimConfig, RunConfig
from psgd.core.errors import UsageError
from psgd.core.sharding import shard_ranges
from psgd.ps.exchange import PSExchange
from psgd.train import assemble, models
from tests.helpers import ENV, events, processes_mentioning, psgd_main, summary
from tests.test_equivalence import DATA, OPTIM, STEPS, run_plain_torch

TIMEOUT = datetime.timedelta(seconds=60)  # a broken test fails, it does not hang


def _spawn(fn, n: int, *args) -> None:
    """Run fn(rank, n, *args) in n processes forked from this one (torch already imported: no
    interpreter start-up and torch import per rank); re-raises the first child failure."""
    mp.start_processes(fn, args=(n, *args), nprocs=n, join=True, start_method="fork")


def _join_group(rank: int, n: int, rdv: str) -> None:
    os.environ.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=n, timeout=TIMEOUT)


# -- the ring ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [1, 2, 7, 12, 1001])
def test_ring_schedule_sums_every_chunk_everywhere(n, numel):
    """The schedule alone, simulated in lockstep: what r receives is what r-1 sends."""
    gen = torch.Generator().manual_seed(n * 1000 + numel)
    bufs = [torch.randint(-50, 50, (numel,), generator=gen).double() for _ in range(n)]
    expected = torch.stack(bufs).sum(0)
    chunks = [[b[s:e] for s, e in shard_ranges(numel, n)] for b in bufs]
    for phase, combine in ((reduce_scatter_step, torch.Tensor.add_), (all_gather_step, torch.Tensor.copy_)):
        for step in range(n - 1):
            sent = [chunks[r][phase(r, n, step)[0]].clone() for r in range(n)]
            for r in range(n):
                left = (r - 1) % n
                assert phase(r, n, step)[1] == phase(left, n, step)[0]
                combine(chunks[r][phase(r, n, step)[1]], sent[left])
    for b in bufs:
        assert torch.equal(b, expected)


def _data(rank: int, numel: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 7919 + numel)
    if kind == "int":
        return torch.randint(-1000, 1000, (numel,), generator=g).float()
    return torch.randn(numel, generator=g)


def _ring_vs_library(rank: int, n: int, rdv: str) -> None:
    _join_group(rank, n, rdv)
    for numel in sorted({1, n - 1, n, n + 1, 2 * n + 1, 1000, 1003} - {0}):
        # Integers: every summation order gives the exact sum. Normals: within float tolerance.
        for kind in ("int", "normal"):
            ring, library = _data(rank, numel, kind), _data(rank, numel, kind)
            traffic = ring_all_reduce(ring)
            dist.all_reduce(library)
            expected = torch.stack([_data(r, numel, kind) for r in range(n)]).sum(0)
            if kind == "int":
                assert torch.equal(ring, expected) and torch.equal(library, expected), numel
            else:
                torch.testing.assert_close(ring, library, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(ring, expected, rtol=1e-5, atol=1e-5)
            # Each rank sends 2(N-1) chunks; chunk sizes differ by at most one element.
            assert abs(traffic.sent - ring_bytes(numel, n, 4)) <= 2 * (n - 1) * 4, (numel, traffic)
            totals = torch.tensor([traffic.sent, traffic.received], dtype=torch.float64)
            dist.all_reduce(totals)
            assert totals[0] == totals[1]  # every byte sent is received by someone
    dist.destroy_process_group()


# 3 ranks in real processes over gloo (an odd ring: chunks of unequal sizes, the case that can go
# wrong); the schedule of every ring from 1 to 5 ranks, even ones included, is the pure test above,
# and 2 ranks, a plain exchange, is every 2-worker all-reduce run. (4 ranks here cost make test 9 s.)
@pytest.mark.parametrize("n", [3])
def test_hand_written_ring_equals_dist_all_reduce(tmp_path, n):
    _spawn(_ring_vs_library, n, str(tmp_path / "rdv"))


# -- replicas ------------------------------------------------------------------------------------

def _replicas(rank: int, n: int, tmp: str) -> None:
    os.environ.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    for impl in ("library", "ring"):  # one group after the other, in the same processes
        _replicas_of(rank, n, f"{tmp}/rdv-{impl}", f"{tmp}/out-{impl}", impl)


def _replicas_of(rank: int, n: int, rdv: str, out: str, impl: str) -> None:
    optim = OptimConfig(lr=0.1, momentum=0.9, weight_decay=1e-3, warmup=2)
    # bucket_mb 0.0005 = 131 floats: the 168 parameters of this logreg are reduced in two buckets.
    cfg = CollectiveOptions(steps=4, check_every=1, bucket_mb=0.0005, allreduce_impl=impl, optim=optim,
                            device="cpu", out=out, eval_every=2)
    model = models.build(ModelConfig("logreg"), 20, 8, seed=rank)  # deliberately different: setup broadcasts
    flat = models.FlatParams(model)
    ex = CollectiveExchange(cfg, Rendezvous(rank, n, rank, n, f"file://{rdv}"), "gloo")
    ex.setup(flat, rank)

    reference = models.FlatParams(models.build(ModelConfig("logreg"), 20, 8, seed=0)).params.clone()
    reference.grad = torch.zeros_like(reference)
    ref_opt = torch.optim.SGD([reference], lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    assert torch.equal(flat.params, reference)
    for step in range(cfg.steps):
        grads = [torch.randn(flat.grads.numel(), generator=torch.Generator().manual_seed(100 * step + r))
                 for r in range(n)]
        flat.grads.copy_(grads[rank])
        report = ex.after_compute(step, flat)
        assert report.done == (step == cfg.steps - 1)
        for group in ref_opt.param_groups:
            group["lr"] = optim.lr * min(1.0, (step + 1) / optim.warmup)
        reference.grad.copy_(torch.stack(grads).mean(0))
        ref_opt.step()
        torch.testing.assert_close(flat.params, reference, rtol=1e-5, atol=1e-6)
    assert ex.stats["checks"] == cfg.steps  # check_every=1: compared after every update

    if rank == 1:
        flat.params[3] += 1e-3  # a bit flip's worth of corruption on one replica
    with pytest.raises(CollectiveError, match=r"rank\(s\) 1 hold parameters different"):
        ex.check_replicas(flat.params)
    if rank == 1:
        flat.params[3] -= 1e-3
    ex.close()


def test_replicas_stay_identical_and_a_corrupted_one_is_detected(tmp_path):
    _spawn(_replicas, 3, str(tmp_path))
    for impl in ("library", "ring"):
        out = tmp_path / f"out-{impl}"
        assert [v for v, _, _ in torch.load(out / "replica-0.pt")["snapshots"]] == [0, 2, 4]
        assert sorted(p.name for p in out.glob("replica-*.json")) == ["replica-0.json", "replica-1.json",
                                                                       "replica-2.json"]


# -- whole runs ----------------------------------------------------------------------------------

TRAIN = ["--dataset", "synthetic", "--num-samples", "2000", "--model", "mlp", "--width", "32", "--seed", "3",
         "--lr", "0.1", "--momentum", "0.9", "--weight-decay", "1e-3", "--steps", str(STEPS), "--device", "cpu",
         "--eval-every", "10"]


def sync_ps_params(shards, workers: int, batch: int, optim: OptimConfig) -> torch.Tensor:
    """Sync PS in this process (threads + in-process shards), as in test_equivalence."""
    cfg = RunConfig(mode="sync", workers=workers, servers=2, batch_size=batch, steps=STEPS, seed=3, optim=optim,
                    data=DATA, model=ModelConfig(model="mlp", width=32), device="cpu")
    addresses, cores = shards(cfg)
    threads = [threading.Thread(target=assemble.train_worker, args=(cfg, r, PSExchange(addresses, "fp32", 30.0), None))
               for r in range(workers)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert all(s.policy.version == STEPS for s in cores)
    return torch.cat([s.param.detach().clone() for s in cores])


@pytest.mark.usefixtures("warm_runs")
def test_allreduce_4x8_equals_sync_ps_4x8_equals_1x32(tmp_path, shards):
    out = tmp_path / "ar"
    r = psgd_main("run", "--mode", "allreduce", "--workers", "4", "--batch-size", "8", "--check-every", "5",
                  "--out", str(out), *TRAIN)
    assert r.returncode == 0, r.stderr
    allreduce = torch.load(out / "final_params.pt")
    ps = sync_ps_params(shards, workers=4, batch=8, optim=OPTIM)
    assert (allreduce - ps).abs().max() < 1e-5
    assert (allreduce - run_plain_torch(32)).abs().max() < 1e-5
    s = summary(out)
    assert s["mode"] == "allreduce" and s["servers"] == 0 and s["global_updates"] == STEPS
    assert s["replicas_consistent"] is True and s["consistency_checks"] == 5  # updates 5, 10, 15, 20, 25
    assert s["backend"] == "gloo" and s["allreduce_impl"] == "library" and s["bytes_sent_estimated"] is True
    assert s["bytes_sent"] == {str(k): STEPS * ring_bytes(s["params"], 4, 4) for k in range(4)}
    assert s["bytes_pushed"] == sum(s["bytes_sent"].values())
    assert s["per_worker_steps"] == {str(k): STEPS for k in range(4)}
    assert [e["version"] for e in events(out) if e["event"] == "eval"] == [0, 10, 20, 25]
    assert processes_mentioning(str(out)) == []


@pytest.mark.usefixtures("warm_runs")
def test_ring_run_with_warmup_and_buckets_equals_sync_ps(tmp_path, shards):
    out = tmp_path / "ring"
    r = psgd_main("run", "--mode", "allreduce", "--allreduce-impl", "ring", "--workers", "3", "--batch-size", "8",
                  "--warmup", "5", "--bucket-mb", "0.02", "--out", str(out), *TRAIN)
    assert r.returncode == 0, r.stderr
    ring = torch.load(out / "final_params.pt")
    ps = sync_ps_params(shards, workers=3, batch=8, optim=OptimConfig(lr=0.1, momentum=0.9, weight_decay=1e-3,
                                                                      warmup=5))
    assert (ring - ps).abs().max() < 1e-5
    s = summary(out)
    assert s["replicas_consistent"] is True and s["bytes_sent_estimated"] is False
    # Exact ring traffic: within 2(N-1) elements per bucket of the textbook 2(N-1)/N x size.
    buckets = -(-s["params"] // (int(0.02 * 2**20) // 4))
    for sent in s["bytes_sent"].values():
        assert abs(sent - STEPS * ring_bytes(s["params"], 3, 4)) <= STEPS * buckets * 2 * 2 * 4
    assert processes_mentioning(str(out)) == []


# -- failures ------------------------------------------------------------------------------------

@pytest.mark.usefixtures("warm_runs")
def test_dead_rank_fails_the_run_and_leaves_no_process(tmp_path):
    out = tmp_path / "dead"
    r = psgd_main("run", "--mode", "allreduce", "--workers", "3", "--steps", "500", "--fail-at", "1=3",
                  "--rpc-timeout", "30", "--out", str(out), *TRAIN[:8])
    assert r.returncode == 1
    assert "worker" in r.stderr and "died" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert processes_mentioning(str(out)) == []


def test_dead_rank_without_a_launcher_is_an_error_not_a_hang(tmp_path, request):
    """As under torchrun on several hosts: nobody kills the survivors; their collectives must fail.
    The three `psgd worker` processes are forked from this test process's warm parent (tests/warm.py),
    which only forks and reaps them, as psgd run's children are (no interpreter and torch import each)."""
    from psgd.allreduce.collective import free_port

    out = tmp_path / "bare"
    env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="3")
    args = ["worker", "--mode", "allreduce", "--workers", "3", "--steps", "500", "--fail-at", "1=3", "--rpc-timeout",
            "30", "--out", str(out), *TRAIN[:8]]
    warm = request.getfixturevalue("warm_parent").get()
    with contextlib.ExitStack() as files:
        null = files.enter_context(open(os.devnull, "r+b"))
        errs = [files.enter_context(tempfile.TemporaryFile()) for _ in range(3)]
        procs = [warm.spawn(args, dict(env, RANK=str(r)), null.fileno(), null.fileno(), errs[r].fileno())
                 for r in range(3)]
        try:
            codes = [p.wait(timeout=120) for p in procs]
        finally:
            for p in procs:
                p.kill()
                p.wait()
        results = []
        for code, err in zip(codes, errs, strict=True):
            err.seek(0)
            results.append((code, err.read().decode()))
    assert results[1][0] == -9  # SIGKILLed itself at step 3
    for rank in (0, 2):
        rc, err = results[rank]
        assert rc == 1, err
        assert err.startswith(f"psgd worker {rank}: error: all-reduce of update 4 failed"), err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert processes_mentioning(str(out)) == []


# -- configuration ---------------------------------------------------------------------------------

def test_backend_choice():
    assert choose_backend("auto", "auto", local_world_size=4, cuda_devices=0) == "gloo"
    assert choose_backend("auto", "auto", local_world_size=4, cuda_devices=4) == "nccl"
    assert choose_backend("auto", "auto", local_world_size=4, cuda_devices=2) == "gloo"  # GPUs shared
    assert choose_backend("auto", "cpu", local_world_size=2, cuda_devices=8) == "gloo"
    assert choose_backend("gloo", "auto", local_world_size=2, cuda_devices=8) == "gloo"
    assert choose_backend("nccl", "cuda", local_world_size=2, cuda_devices=2) == "nccl"
    with pytest.raises(UsageError, match="4 ranks and torch sees 2 CUDA"):
        choose_backend("nccl", "auto", local_world_size=4, cuda_devices=2)
    with pytest.raises(UsageError, match="--device cpu"):
        choose_backend("nccl", "cpu", local_world_size=1, cuda_devices=1)


def test_rendezvous_from_the_standard_variables():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
           "LOCAL_WORLD_SIZE": "4"}
    assert Rendezvous.from_env(7, 8, env) == Rendezvous(7, 8, 3, 4, "env://")
    assert Rendezvous.from_env(1, 2, {"MASTER_ADDR": "h", "MASTER_PORT": "1"}) == Rendezvous(1, 2, 1, 2)
    with pytest.raises(UsageError, match="WORLD_SIZE=8 but --workers 4"):
        Rendezvous.from_env(0, 4, env)
    with pytest.raises(UsageError, match=r"\$MASTER_PORT"):
        Rendezvous.from_env(0, 2, {"MASTER_ADDR": "h"})


@pytest.mark.parametrize("argv,message", [
    (["run", "--mode", "allreduce", "--backend", "nccl"], "--backend nccl needs one CUDA device per rank"),
    (["worker", "--mode", "allreduce", "--backend", "nccl", "--rank", "0"], "--backend nccl needs one CUDA"),
    (["worker", "--mode", "allreduce", "--rank", "0"], "needs $MASTER_ADDR and $MASTER_PORT"),
    (["run", "--mode", "allreduce", "--wire-dtype", "fp16"], "--wire-dtype is a parameter-server option"),
    (["run", "--bucket-mb", "0"], "--bucket-mb must be > 0"),
    (["run", "--check-every", "-1"], "--check-every must be >= 0"),
])
def test_usage_errors_are_one_line_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    if argv[0] == "worker":
        monkeypatch.delenv("MASTER_ADDR", raising=False)
        monkeypatch.delenv("MASTER_PORT", raising=False)
        if "nccl" in argv:
            monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
            monkeypatch.setenv("MASTER_PORT", "1")
    assert cli.main([*argv, "--out", str(tmp_path / "out"), "--dataset", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
