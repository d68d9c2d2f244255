"""04 - the real thing: `psgd run` for sync, async and SSP, as processes, with a straggler.

`launch.run` starts the shard servers and workers as separate processes (exactly the commands
`psgd server` / `psgd worker` you could start on other hosts), waits, evaluates, and returns
summary.json. Worker 0 of 2 is 30 ms slower per step. The claims, checked at the end: sync makes every
worker wait for it (both do the same number of steps), async lets the other run ahead (it does
more steps than the straggler, and more than one clock ahead), and SSP lets it run ahead by at
most `staleness` clocks.

    python examples/05_processes_straggler.py
"""

import tempfile

from psgd.core.config import DataConfig, RunConfig
from psgd.train import launch

summaries = {}
with tempfile.TemporaryDirectory() as tmp:
    for mode in ("sync", "async", "ssp"):
        cfg = RunConfig(mode=mode, workers=2, servers=1, staleness=1, steps=30, straggler=((0, 30),),
                        data=DataConfig(dataset="synthetic", num_samples=2000), out=f"{tmp}/{mode}")
        s = summaries[mode] = launch.run(cfg)
        print(f"{mode:5s}: {s['worker_steps_per_s']:6.1f} gradients/s, test accuracy {s['final_test_accuracy']:.3f}, "
              f"max clock gap {s['max_clock_gap']}, worker steps {s['per_worker_steps']}")

steps = {mode: s["per_worker_steps"] for mode, s in summaries.items()}
assert len(set(steps["sync"].values())) == 1, "sync: every worker does every step"
assert steps["async"]["0"] < max(steps["async"].values()), "async: the other worker does not wait for the straggler"
assert summaries["ssp"]["max_clock_gap"] <= 1, "SSP(1): nobody runs more than one clock ahead"
assert summaries["async"]["max_clock_gap"] > 1, "async bounds nothing: the fast worker runs further ahead"
assert all(sum(s.values()) == 2 * 30 for s in steps.values()), "every mode spends the same budget of gradients"
