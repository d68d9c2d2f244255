"""02 - a parameter server in one process: 2 gRPC shards, 4 worker threads, sync (BSP).

The same pieces `psgd run` uses, without processes: `server.start` binds 127.0.0.1:0,
`worker.train` runs the loop with a `PSExchange` (pull -> compute -> push). The result equals
examples/01_single.py's loop with batch 4 x 16 = 64 (see tests/test_equivalence.py).

    python examples/02_sync_ps_in_process.py
"""

import threading

import torch

from psgd.core.config import DataConfig, RunConfig
from psgd.ps import server
from psgd.ps.exchange import PSExchange
from psgd.train import worker

cfg = RunConfig(mode="sync", workers=4, servers=2, batch_size=16, steps=200, device="cpu",
                data=DataConfig(dataset="synthetic", num_samples=4000))
started = [server.start(cfg, k) for k in range(cfg.servers)]   # each on 127.0.0.1, a free port
addresses = [f"127.0.0.1:{s.port}" for s in started]

threads = [threading.Thread(target=worker.train, args=(cfg, rank, PSExchange(addresses), None))
           for rank in range(cfg.workers)]
for t in threads:
    t.start()
for t in threads:
    t.join()

params = torch.cat([s.shard.param for s in started])
print(f"{cfg.workers} workers, {cfg.servers} shards: version {started[0].shard.policy.version}, "
      f"{params.numel()} parameters, |params| = {params.norm():.4f}")
for s in started:
    s.stop()
