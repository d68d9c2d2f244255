"""02 - a parameter server in one process: 2 gRPC shards, 4 worker threads, sync (BSP).

The same pieces `psgd run` uses, without processes: `server.start` binds 127.0.0.1:0,
`worker.train` runs the loop with a `PSExchange` (pull -> compute -> push). The claim, checked at
the end: the parameters equal those of examples/01_one_process.py's plain torch loop with batch
4 x 16 = 64, to float rounding (the shards average 4 gradients of 16 where torch takes one of 64).

    python examples/04_threads_equal_torch.py
"""

import runpy
import threading
from pathlib import Path

import torch

from psgd.core.config import DataConfig, RunConfig
from psgd.ps import server
from psgd.ps.exchange import PSExchange
from psgd.train import worker

cfg = RunConfig(mode="sync", workers=4, servers=2, batch_size=16, steps=100, device="cpu",
                data=DataConfig(dataset="synthetic", num_samples=4000))
started = [server.start(cfg, k) for k in range(cfg.servers)]   # each on 127.0.0.1, a free port
addresses = [f"127.0.0.1:{s.port}" for s in started]

threads = [threading.Thread(target=worker.train, args=(cfg, rank, PSExchange(addresses), None))
           for rank in range(cfg.workers)]
for t in threads:
    t.start()
for t in threads:
    t.join(300)
assert not any(t.is_alive() for t in threads), "a worker is stuck"

params = torch.cat([s.shard.param for s in started])
print(f"{cfg.workers} workers, {cfg.servers} shards: version {started[0].shard.policy.version}, "
      f"{params.numel()} parameters, |params| = {params.norm():.4f}")
for s in started:
    s.stop()

reference = runpy.run_path(str(Path(__file__).with_name("01_one_process.py")))["model"]  # runs 01's loop
expected = torch.cat([q.detach().reshape(-1) for q in reference.parameters()])
gap = float((params - expected).abs().max())
print(f"largest difference from 01_one_process.py's parameters: {gap:.1e}")
assert gap < 1e-4, "sync PS must reproduce single-process SGD on the same global batches"
