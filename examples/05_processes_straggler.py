"""05 - the real thing: `psgd run` starts the shard server and the workers as processes; a straggler.

What it shows: the cost of one slow worker, side by side with a run without it. `launch.run` is
`psgd run`: it starts `psgd server` and `psgd worker` processes (the commands you could start by
hand on other hosts), waits for them, evaluates, and returns summary.json. Two tiny sync runs of
2 workers and 1 shard, 20 updates each:

- no straggler: the baseline;
- worker 0 sleeps 40 ms more per step (`--straggler 0=40`, an emulated slower device): every
  update waits for it, so the whole run pays about 40 ms per update, and worker 1 spends that
  time held by the shard (its push waits for worker 0's gradient of the step: sync adds a step's
  gradients in worker order), which it records as wait_s, not push time. The updates themselves
  do not change: both runs end with the same parameters, bit for bit (summary.json's params_sha256).

torch's CPU kernels are pinned to AVX2 here, as the suite and the tests pin them
(ATEN_CPU_CAPABILITY=avx2, psgd/lab/runner.py `pin_cpu_kernels`; a value you set is kept), so that
the hash does not change with the machine's vector width; MKL still picks its matrix kernels by CPU
vendor, so an AMD and an Intel CPU print two hashes (the two rows always share theirs).

What async does with the same straggler (nobody waits; its gradients arrive stale) is step 07.

    python examples/05_processes_straggler.py
    psgd run --mode sync --workers 2 --servers 1 --steps 20 --num-samples 2000 --straggler 0=40   # one, by hand

Times vary with the machine and its load; the claims checked at the end do not depend on them.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path

from psgd.core.config import DataConfig, RunConfig
from psgd.lab.runner import pin_cpu_kernels
from psgd.train import launch
from psgd.train.metrics import read_events

DELAY_MS = 40  # large enough to stand out on 2 shared cores, small enough to keep the example quick
STEPS = 20


def step_times(out: Path, rank: int) -> dict[str, float]:
    """Worker `rank`'s steady state from its step events in metrics.jsonl, in ms: the median time
    from one step's end to the next (pull, wait, compute, push), the median time the shard held it
    (wait_s: its push waiting for its turn, its pull held) and the median push time.

    Medians over steps 1.. rather than summary.json's wall_time_s: the run's clock starts with its
    earliest worker, and a worker that asks for its first pull before the chief has initialised
    the shard counts that start-up wait as step 0's pull time, which would swamp a 20-step run.
    """
    steps = sorted((e for e in read_events(out / "metrics.jsonl") if e.get("event") == "step" and e["rank"] == rank),
                   key=lambda e: e["clock"])
    return {"step": 1000 * statistics.median(b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False)),
            "wait": 1000 * statistics.median(e["wait_s"] for e in steps[1:]),
            "push": 1000 * statistics.median(e["push_s"] for e in steps[1:])}


def main() -> None:
    kernels = pin_cpu_kernels()  # for the processes launch.run starts (the hash follows the kernels)
    base = RunConfig(workers=2, servers=1, steps=STEPS, eval_every=0, device="cpu",
                     data=DataConfig(dataset="synthetic", num_samples=2000))
    runs = {"baseline": base, "straggler": dataclasses.replace(base, straggler=((0, DELAY_MS),))}
    summaries, times = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in runs.items():
            out = Path(tmp) / name
            extra = f" --straggler 0={DELAY_MS}" if cfg.straggler else ""
            print(f"{name}: psgd run --mode sync --workers 2 --servers 1 --steps {STEPS} --num-samples 2000 "
                  f"--eval-every 0 --device cpu{extra}", flush=True)  # what launch.run(cfg) amounts to
            summaries[name] = launch.run(dataclasses.replace(cfg, out=str(out)))
            times[name] = step_times(out, rank=1)  # the fast worker: what it pays for the slow one

    print(f"sync, 2 worker processes, 1 shard process, {STEPS} updates; straggler: worker 0, +{DELAY_MS} ms per step;"
          f" torch CPU kernels {kernels}")
    print("run         ms per update  worker 1 held, ms  steps w0, w1  test accuracy  final parameters")
    for name, s in summaries.items():
        steps = s["per_worker_steps"]
        print(f"{name:10s}  {times[name]['step']:13.1f}  {times[name]['wait']:17.1f}  {steps['0']:>5d}, "
              f"{steps['1']:>4d}  {s['final_test_accuracy']:13.3f}  sha256 {s['params_sha256'][:12]}")
    cost = times["straggler"]["step"] - times["baseline"]["step"]
    print(f"(ms: medians over steps 1..{STEPS - 1} of worker 1, from metrics.jsonl)")
    print(f"sync: the straggler costs every update {cost:.0f} ms (its own delay is {DELAY_MS} ms), which worker 1 "
          f"spends held by the shard (wait, not push); the updates are the same, bit for bit, only later")

    # The claims: facts of the runs, not of the clock.
    for name, s in summaries.items():
        assert s["per_worker_steps"] == {"0": STEPS, "1": STEPS}, f"{name}: in sync every worker does every step"
        assert s["global_updates"] == STEPS and s["staleness"]["max"] == 0, f"{name}: one fresh update per step"
    # A straggler changes when, never what: the same two gradients are averaged in every step (and
    # a + b == b + a in floating point, so with 2 workers the arrival order cannot matter either).
    assert summaries["straggler"]["params_sha256"] == summaries["baseline"]["params_sha256"], "same updates"
    # The straggler computes every one of the STEPS updates and sleeps DELAY_MS in each: no run
    # that waits for it can be shorter, however fast the machine.
    assert summaries["straggler"]["wall_time_s"] >= STEPS * DELAY_MS / 1000, "sync waits for the straggler"
    # ... and worker 1's share of that wait is recorded as waiting (the shard held its push for its
    # turn), not as pushing: the same transfer as the baseline's, on a shard with nothing else to do.
    held = times["straggler"]
    assert held["wait"] > held["push"] and held["wait"] > times["baseline"]["wait"], f"worker 1 held: {held}"


if __name__ == "__main__":
    main()
