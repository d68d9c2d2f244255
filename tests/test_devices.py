"""Which device each worker computes on (psgd/core/devices.py), on any machine: the arithmetic for every
host shape, the flag's parsing, and the one-line refusals (exit 2) of a device the host lacks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from psgd import cli
from psgd.allreduce.collective import choose_backend
from psgd.core import config as C
from psgd.core.devices import DeviceError, parse_device, pick_device
from psgd.core.errors import UsageError
from tests.conftest import gpu_skip_reason


@pytest.mark.parametrize("spec,parsed", [("auto", ("auto", None)), ("cpu", ("cpu", None)), ("cuda", ("cuda", None)),
                                         ("cuda:0", ("cuda", 0)), ("cuda:13", ("cuda", 13))])
def test_device_specs_parse(spec, parsed):
    assert parse_device(spec) == parsed
    assert C.validate(C.RunConfig(device=spec)).device == spec


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1:2", "cpu:0", "auto:1", "CUDA", ""])
def test_bad_device_specs_are_one_line_exit_2(spec, capsys):
    with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N"):
        parse_device(spec)
    assert cli.main(["run", "--device", spec, "--out", "/nonexistent/never-made"]) == 2
    err = capsys.readouterr().err
    assert "--device must be auto, cpu, cuda or cuda:N" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("spec,rank,local_rank,count,picked", [
    ("cpu", 3, None, 8, "cpu"),          # asked for: the CPU even with GPUs
    ("auto", 3, None, 0, "cpu"),         # no GPU: auto falls back
    ("auto", 3, None, 8, "cuda:3"),      # with GPUs auto is cuda
    ("cuda", 0, None, 1, "cuda:0"),
    ("cuda", 5, None, 8, "cuda:5"),      # psgd run, one host: rank r on GPU r
    ("cuda", 5, None, 2, "cuda:1"),      # more workers than GPUs: round robin
    ("cuda", 13, 5, 8, "cuda:5"),        # second host of 8 (torchrun): LOCAL_RANK, not the global rank
    ("cuda", 13, 0, 8, "cuda:0"),
    ("cuda:3", 0, None, 8, "cuda:3"),    # pinned: every worker that asks
    ("cuda:3", 6, 2, 4, "cuda:3"),
    ("cuda:0", 9, None, 1, "cuda:0"),
])
def test_pick_device(spec, rank, local_rank, count, picked):
    assert pick_device(spec, rank, local_rank, count) == picked


@pytest.mark.parametrize("count", [1, 2, 3, 8])
@pytest.mark.parametrize("workers", [1, 2, 5, 8, 16])
def test_the_workers_of_a_host_spread_evenly_over_its_gpus(count, workers):
    """The bug this replaces: every worker on cuda (device 0). Now no GPU holds more than one
    worker more than another, and each holds one while there are enough."""
    load = Counter(pick_device("cuda", r, None, count) for r in range(workers))
    assert set(load) == {f"cuda:{k}" for k in range(min(count, workers))}
    assert max(load.values()) - min(load.values()) <= 1
    # The same with the ranks of a second host (global ranks offset, LOCAL_RANK from 0).
    assert Counter(pick_device("cuda", workers + r, r, count) for r in range(workers)) == load


@pytest.mark.parametrize("spec,count,message", [
    ("cuda", 0, "--device cuda, but torch sees no CUDA device"),
    ("cuda:0", 0, "--device cuda:0, but torch sees no CUDA device"),
    ("cuda:2", 2, "--device cuda:2, but this host has 2 CUDA device(s), cuda:0..cuda:1"),
    ("cuda:9", 8, "this host has 8 CUDA device(s), cuda:0..cuda:7; use one of those, or --device cuda"),
])
def test_a_device_the_host_lacks_is_refused(spec, count, message):
    with pytest.raises(DeviceError) as e:
        pick_device(spec, 0, None, count)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("count,message", [(0, "torch sees no CUDA device"),
                                           (2, "--device cuda:3, but this host has 2 CUDA device(s)")])
def test_worker_refuses_a_device_index_beyond_the_host_in_one_line(tmp_path, monkeypatch, capsys, count, message):
    """At the worker, before it connects (nothing listens on 127.0.0.1:9) or writes anything."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    out = tmp_path / "w"
    argv = ["worker", "--rank", "0", "--workers", "1", "--servers", "127.0.0.1:9", "--device", "cuda:3",
            "--out", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("psgd worker: error: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_nccl_refusals_name_the_fix():
    with pytest.raises(UsageError, match=r"4 ranks and torch sees 2 CUDA device\(s\) for NCCL: run at most one rank "
                                         r"per GPU \(--workers 2, or torchrun --nproc-per-node 2\)"):
        choose_backend("nccl", "cuda", local_world_size=4, cuda_devices=2)
    with pytest.raises(UsageError, match="cuda:1 puts all 2 ranks of this host on one GPU: use --device cuda"):
        choose_backend("nccl", "cuda:1", local_world_size=2, cuda_devices=2)
    assert choose_backend("auto", "cuda:1", local_world_size=2, cuda_devices=2) == "gloo"  # shared GPU: gloo
    assert choose_backend("nccl", "cuda:1", local_world_size=1, cuda_devices=2) == "nccl"  # one rank here


def test_gpu_tests_are_skipped_saying_why():
    assert gpu_skip_reason(1, 1) is None and gpu_skip_reason(2, 4) is None
    assert gpu_skip_reason(1, 0) == "needs 1 CUDA device(s), torch sees no CUDA device: runs on a GPU host " \
                                    "(make gpu-check)"
    assert "needs 2 CUDA device(s), torch sees 1 CUDA device(s)" in gpu_skip_reason(2, 1)
