"""04 - the real thing: `psgd run` for sync, async and SSP, as processes, with a straggler.

`launch.run` starts the shard servers and workers as separate processes (exactly the commands
`psgd server` / `psgd worker` you could start on other hosts), waits, evaluates, and returns
summary.json. Compare how much one slow worker costs each mode.

    python examples/04_run_modes.py
"""

from psgd.core.config import DataConfig, RunConfig
from psgd.train import launch

for mode in ("sync", "async", "ssp"):
    cfg = RunConfig(mode=mode, workers=3, servers=2, staleness=1, steps=60, straggler=((0, 30),),
                    data=DataConfig(dataset="synthetic"), out=f"results/runs/example-{mode}")
    s = launch.run(cfg)
    print(f"{mode:5s}: {s['worker_steps_per_s']:6.1f} gradients/s, test accuracy {s['final_test_accuracy']:.3f}, "
          f"max clock gap {s['max_clock_gap']}, worker steps {s['per_worker_steps']}")
