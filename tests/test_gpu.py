"""On a GPU: pinned staging, PS workers on their own devices equal to the CPU, --overlap, NCCL all-reduce.

Marked `gpu` (tests/conftest.py): they run wherever torch sees CUDA (`make gpu-check` runs `-m gpu`) and
are reported as skipped, with the reason, elsewhere. The tolerance against the CPU is psgd/lab/doctor.py's
reasoning on parameters: fp32 rounding of other kernels, far below what a wrong copy would do.
"""

from __future__ import annotations

import pytest
import torch

from psgd.core.config import RunConfig
from psgd.ps.staging import HostStaging
from psgd.train.worker import worker_device
from tests.helpers import processes_mentioning, psgd_main, summary, train_in_threads
from tests.test_collective import TRAIN, sync_ps_params
from tests.test_equivalence import DATA, OPTIM, STEPS
from tests.test_overlap import MODEL

pytestmark = pytest.mark.gpu
ATOL = 1e-4  # parameters of about 0.1 after 25 steps; a wrong copy moves them by about lr x gradient, 1e-3 and up


def test_staging_on_cuda_is_pinned_allocated_once_and_copies_ranges():
    params, grads = torch.zeros(1000, device="cuda"), torch.arange(1000.0, device="cuda")
    s = HostStaging(params, grads)
    assert s.staged and s.pinned and s.params.is_pinned() and s.grads.is_pinned()
    storages = (s.params.data_ptr(), s.grads.data_ptr())
    for step in range(3):
        s.host_params()[:] = step + 1.0
        s.to_device(0, 500)  # no wait: the compute stream is made to wait for it
        s.to_device(500, None)
        assert torch.equal(params.cpu(), torch.full((1000,), step + 1.0))  # queued after the copies
        grads.add_(1)
        assert s.host_copy(grads) is s.grads and torch.equal(s.grads, grads.cpu())
        s.to_host(10, 20, source=params).wait()
        assert torch.equal(s.grads[10:20], torch.full((10,), step + 1.0))
    assert (s.params.data_ptr(), s.grads.data_ptr()) == storages


def test_each_worker_gets_a_device_that_exists():
    count = torch.cuda.device_count()
    picked = [worker_device("cuda", r) for r in range(2 * count)]
    assert {d.index for d in picked} == set(range(count))
    for d in picked:
        assert torch.ones(2, device=d).sum().item() == 2.0


def _sync_ps(shards, device: str, overlap: bool = False) -> torch.Tensor:
    cfg = RunConfig(mode="sync", workers=2, servers=2, batch_size=16, steps=STEPS, seed=3, optim=OPTIM, data=DATA,
                    model=MODEL, device=device, overlap=overlap)
    addresses, cores = shards(cfg)
    return train_in_threads(cfg, addresses, cores)


def test_sync_ps_workers_on_gpus_equal_the_cpu(shards):
    cpu = _sync_ps(shards, "cpu")
    gpu = _sync_ps(shards, "cuda")
    assert (gpu - cpu).abs().max() < ATOL
    assert (_sync_ps(shards, "cuda", overlap=True) - gpu).abs().max() < ATOL


@pytest.mark.gpu(devices=2)
def test_nccl_allreduce_one_gpu_per_rank_equals_sync_ps_on_the_cpu(tmp_path, shards):
    out = tmp_path / "nccl"
    argv = ["run", "--mode", "allreduce", "--workers", "2", "--batch-size", "16", "--backend", "nccl",
            "--out", str(out), *TRAIN]
    r = psgd_main(*[("cuda" if a == "cpu" else a) for a in argv])  # TRAIN says --device cpu
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["backend"] == "nccl" and s["replicas_consistent"] is True
    assert {k: w["device"] for k, w in s["worker_devices"].items()} == {"0": "cuda:0", "1": "cuda:1"}
    allreduce = torch.load(out / "final_params.pt")
    assert (allreduce - sync_ps_params(shards, workers=2, batch=16, optim=OPTIM)).abs().max() < ATOL
    assert processes_mentioning(str(out)) == []
