"""03 - the consistency policies alone: who waits for whom (no gRPC, just threads).

A fast worker and a slow one share an SSP(s=1) shard: the fast one may run at most one clock
ahead, so it blocks on pull until the slow one pushes. Swap in `Async` and it never waits; swap in
`Sync` and both advance in lockstep. This is all of psgd/core/consistency.py's job.

    python examples/02_consistency_policies.py
"""

import threading
import time

import torch

from psgd.core.consistency import SSP

shard = torch.zeros(4)
policy = SSP(num_workers=2, apply=lambda g: shard.sub_(0.1 * g), staleness=1)


def work(worker: int, delay_s: float) -> None:
    for clock in range(5):
        out = policy.pull(worker, clock, read=shard.clone)
        print(f"worker {worker} clock {clock}: read version {out.version}, waited {out.wait_s * 1e3:5.1f} ms, "
              f"gap {out.clock_gap}")
        time.sleep(delay_s)  # the "compute": worker 1 is 5x slower
        policy.push(worker, clock, out.version, torch.ones(4))


threads = [threading.Thread(target=work, args=(0, 0.01)), threading.Thread(target=work, args=(1, 0.05))]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
print(f"max clock gap {policy.stats.max_clock_gap} (bound 1); staleness histogram {dict(policy.stats.staleness)}")
assert policy.stats.max_clock_gap <= 1, "SSP(1) let a worker run more than one clock ahead of the slowest"
assert not any(t.is_alive() for t in threads)
