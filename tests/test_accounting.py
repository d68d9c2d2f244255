"""Accounting facts the suite does not treat as findings: they are properties of the code.

- A 2-byte wire dtype moves exactly half the bytes of fp32 per push and per pull (E8).
- k micro-batches accumulated per push send k times fewer pushes for the same samples (E9).
Each is measured on real shards (in-process gRPC servers on 127.0.0.1, port 0) through the
worker loop's own counters, the same counters the suite reports.
"""

import pytest

from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig
from tests.helpers import workers_in_threads

DATA = DataConfig(dataset="synthetic", num_samples=2000)


def totals(shards, **kw) -> list[dict]:
    cfg = RunConfig(mode="sync", workers=2, servers=2, batch_size=8, seed=1, data=DATA, device="cpu",
                    model=ModelConfig(model="mlp", width=32), optim=OptimConfig(lr=0.05), **kw)
    addresses, _ = shards(cfg)
    return workers_in_threads(cfg, addresses)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_moves_half_the_bytes(shards, dtype):
    full, half = totals(shards, steps=6), totals(shards, steps=6, wire_dtype=dtype)
    for f, h in zip(full, half, strict=True):
        assert f["steps"] == h["steps"] == 6
        assert h["bytes_pushed"] * 2 == f["bytes_pushed"] > 0
        assert h["bytes_pulled"] * 2 == f["bytes_pulled"] > 0


def test_accumulation_pushes_k_times_less_for_the_same_samples(shards):
    k = 4
    # Equal samples: 8 pushes of one micro-batch of 8, or 2 pushes of 4 micro-batches of 8.
    one, acc = totals(shards, steps=8), totals(shards, steps=2, accumulate=k)
    for a, b in zip(one, acc, strict=True):
        assert a["steps"] == k * b["steps"]
        assert a["bytes_pushed"] == k * b["bytes_pushed"]
