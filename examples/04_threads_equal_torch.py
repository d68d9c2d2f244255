"""04 - a parameter server in one process: K shard servers, N worker threads, sync mode, vs plain torch.

What it shows: sync (BSP) SGD with N workers x batch b computes what one process computes with
batch N x b. The pieces are the ones `psgd run` uses, minus the processes: `server.start` serves
each shard on 127.0.0.1 (a free port), `worker.train` runs the real worker loop with a
`PSExchange` (pull -> forward/backward -> push). The reference is examples/01's loop, loaded from
that file. Printed: the largest difference from it, the tolerance it is checked against, and
why a difference is not zero where it is not, for three setups that each change one thing:

- 1 worker x 64 on 1 shard: bit-equal here; the same sums, the same fused SGD kernel as 01.
- 4 workers x 16 on 1 shard: the shard averages four gradients, each the mean over 16 samples,
  summed in worker order ((g0 + g1) + g2 ..., whatever order the pushes arrived in, so the
  result is the same on every run), where torch takes one mean over 64. Mathematically the same
  number; in float32 the same terms added in another order, and float addition is not associative.
- 1 worker x 64 on 2 shards: each shard steps its slice of the flat vector as one tensor, cut
  inside a layer; torch's vectorised SGD kernel may round an element's update differently in the
  last bit depending on where its tensor starts and ends.
100 steps of momentum SGD carry those last-bit differences along, far below the tolerance.

    python examples/04_threads_equal_torch.py
    python examples/04_threads_equal_torch.py --workers 4 --shards 2     # any one setup instead

`run_threads()` is reused by examples/07 (loaded with runpy).
"""

from __future__ import annotations

import argparse
import dataclasses
import runpy
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from psgd.core.config import RunConfig
from psgd.train import assemble

ONE = runpy.run_path(str(Path(__file__).with_name("01_one_process.py")))  # 01's train(), flat(), DATA
TOLERANCE = 1e-5  # float32 keeps ~7 digits: 100 steps may drift by ~1e-7 here; a real bug (a lost or
                  # doubled gradient, a wrong batch) moves parameters by 1e-3 or more


def run_threads(cfg: RunConfig) -> tuple[torch.Tensor, list[dict], list[dict]]:
    """Serve cfg.servers shards, run cfg.workers worker loops as threads; return the final flat
    parameters (the shards' slices, concatenated), each shard's stats and each worker's totals."""
    shards = [assemble.shard_server(cfg, k) for k in range(cfg.servers)]   # each on 127.0.0.1, port 0
    addresses = [f"127.0.0.1:{s.port}" for s in shards]
    pool = ThreadPoolExecutor(cfg.workers)
    try:
        runs = [pool.submit(assemble.train_worker, cfg, rank, assemble.ps_exchange(cfg, addresses), None)
                for rank in range(cfg.workers)]
        totals = [r.result() for r in runs]  # re-raises a worker's error here
        return torch.cat([s.shard.param for s in shards]), [s.shard.stats() for s in shards], totals
    finally:
        for s in shards:
            s.stop()  # first: releases held pulls, so a failed worker's peers end instead of waiting
        pool.shutdown()


# (workers, shards) compared with 01 by default: each changes one thing from the bit-equal first.
ROWS = ((1, 1), (4, 1), (1, 2))
WHY = {
    "workers": "the shard averages N per-worker mean gradients, summed in worker order whatever order the "
               "pushes arrived in (the same on every run), where 01 takes one mean over the global batch: the "
               "same numbers added in another order, and float32 addition is not associative",
    "shards": "each shard steps its slice of the flat vector as one tensor, cut inside a layer, where 01 steps "
              "six layer tensors; torch's vectorised SGD kernel may round an element's update differently in "
              "the last bit depending on where its tensor starts and ends",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, help="compare this many workers (with --shards) instead of the 3 rows")
    ap.add_argument("--shards", type=int, default=1, help="parameter shards for --workers")
    args = ap.parse_args()
    steps, global_batch = 100, 64
    rows = ((args.workers, args.shards),) if args.workers else ROWS
    if any(w < 1 or k < 1 or global_batch % w for w, k in rows):
        ap.error(f"--workers must divide the global batch {global_batch}; --shards >= 1")

    reference = ONE["flat"](ONE["train"](steps, global_batch)[0])
    moved = float((reference - ONE["flat"](ONE["train"](0)[0])).abs().max())  # 0 steps: the seeded start
    print(f"01's loop (one process, batch {global_batch}, {steps} steps): |params| {reference.norm():.4f}; "
          f"training moved some parameter by up to {moved:.1e}")
    print(f"sync PS, worker threads + shard servers in this process, {steps} steps; largest |difference| from 01 "
          f"(tolerance {TOLERANCE:.0e}):")
    base = RunConfig(mode="sync", steps=steps, device="cpu", data=ONE["DATA"], model=ONE["MODEL"], seed=ONE["SEED"])
    gaps = {}
    for workers, shards in rows:
        cfg = dataclasses.replace(base, workers=workers, servers=shards, batch_size=global_batch // workers)
        params, stats, _ = run_threads(cfg)
        assert all(s["version"] == steps for s in stats), "sync: one update per step, each the mean of N"
        gap = gaps[workers, shards] = float((params - reference).abs().max())
        # Say why from what was measured: a cause is named only where the setup has it.
        causes = [WHY[c] for c, n in (("workers", workers), ("shards", shards)) if n > 1]
        if gap == 0.0:
            why = "bit-equal: the same sums, the same fused SGD kernel as 01"
        elif causes:
            why = "not bit-equal: " + "; and ".join(causes)
        else:
            why = "not bit-equal, for a reason this setup does not show (a kernel of this torch build?)"
        print(f"  {workers} worker(s) x {cfg.batch_size}, {shards} shard(s): |params| {params.norm():.4f}, "
              f"difference {gap:.1e}")
        print(textwrap.fill(why, 100, initial_indent="    ", subsequent_indent="    "))
    print("100 steps of momentum SGD carry last-bit differences along; they stay far below the tolerance.")
    assert max(gaps.values()) < TOLERANCE, f"sync PS must reproduce single-process SGD to float rounding: {gaps}"
    assert moved > 100 * TOLERANCE, "the comparison means something only if training moved the parameters"


if __name__ == "__main__":
    main()
