"""07 - async staleness made visible: how old is the model a gradient was computed on?

What it shows: the staleness histogram a shard keeps (staleness of a gradient = the shard's
version when it is applied - the version the worker pulled; psgd/core/consistency.py), for async
and for SSP(1), same workers, same straggler. 4 workers run as threads against one in-process
shard (examples/04's `run_threads`); worker 0 is 40 ms slower per step. Under async nobody
waits: each fast worker's gradient meets the pushes of the others that came in meanwhile (about
N-1), and every straggler's gradient meets all the fast workers' pushes of 40 ms: the long tail.
SSP(1) holds the fast workers within one clock of the straggler, which caps staleness: between a
worker's pull at clock c and its push, each of the N-1 others pushes only clocks from c-s to c+s,
so staleness <= (N-1)(2s+1), 9 here. summary.json reports it as `staleness` (summed over shards).

    python examples/07_async_staleness.py
    python examples/07_async_staleness.py --run results/runs/latest     # any psgd run's summary.json

The counts depend on timing (threads, the machine's load); the checks at the end do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import runpy
from collections import Counter
from pathlib import Path

from psgd.core.config import RunConfig
from psgd.train.metrics import hist_stats

WORKERS, STEPS, DELAY_MS, BOUND_S = 4, 20, 40, 1


def bars(hists: dict[str, dict], width: int = 30) -> None:
    """Print histograms (name -> hist_stats dict) side by side, one row per staleness value."""
    values = range(max(h["max"] for h in hists.values()) + 1)  # every value, so gaps in the tail show
    top = max(c for h in hists.values() for c in h["hist"].values())
    print(("staleness  " + "  ".join(f"{name:<{width + 6}s}" for name in hists)).rstrip())
    skipped = False
    for v in values:
        counts = [h["hist"].get(str(v), 0) for h in hists.values()]
        if not any(counts):
            if not skipped:
                print("      ...")  # a run of values no gradient had
            skipped = True
            continue
        skipped = False
        print((f"{v:9d}  " + "  ".join(f"{c:4d}  {'#' * round(width * c / top):<{width}s}" for c in counts)).rstrip())
    summary = [f"mean {h['mean']:.1f}, p99 {h['p99']:.0f}, max {h['max']}" for h in hists.values()]
    print(("           " + "  ".join(f"{line:<{width + 6}s}" for line in summary)).rstrip())


def from_run(run: Path) -> None:
    """The histogram of a finished `psgd run` (its summary.json), as it is: no claim checked."""
    s = json.loads((run / "summary.json").read_text())
    print(f"{run}: mode {s['mode']}, {s['workers']} workers, {s['servers']} shard(s), {s['worker_steps']} gradients")
    if not s["servers"]:
        print("all-reduce: no shards, so no versions and no staleness")
        return
    if s["servers"] > 1:
        print(f"(summary.json adds the {s['servers']} shards' histograms: every shard counts every gradient)")
    bars({s["mode"]: s["staleness"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="show the histogram of this psgd run folder instead")
    args = ap.parse_args()
    if args.run:
        from_run(args.run)
        return

    four = runpy.run_path(str(Path(__file__).with_name("04_threads_equal_torch.py")))  # its run_threads()
    one = four["ONE"]  # examples/01's data and model
    base = RunConfig(workers=WORKERS, servers=1, steps=STEPS, device="cpu", data=one["DATA"], model=one["MODEL"],
                     straggler=((0, DELAY_MS),), staleness=BOUND_S, eval_every=0)
    hists, straggled = {}, {}
    for mode in ("async", "ssp"):
        _, stats, totals = four["run_threads"](dataclasses.replace(base, mode=mode))
        name = mode if mode == "async" else f"ssp({BOUND_S})"
        counts = Counter({int(k): v for s in stats for k, v in s["staleness_hist"].items()})
        hists[name], straggled[name] = hist_stats(counts), totals[0]["steps"]
    print(f"{WORKERS} workers as threads, 1 shard, worker 0 +{DELAY_MS} ms per step, "
          f"{WORKERS * STEPS} gradients per run")
    bars(hists)
    print("gradients by the straggler: " + ", ".join(f"{name} {n}" for name, n in straggled.items()))

    bound = (WORKERS - 1) * (2 * BOUND_S + 1)
    for name, h in hists.items():
        assert sum(h["hist"].values()) == WORKERS * STEPS, f"{name}: one staleness per gradient, all counted"
    assert hists[f"ssp({BOUND_S})"]["max"] <= bound, f"SSP({BOUND_S}) caps staleness at (N-1)(2s+1) = {bound}"
    print(f"checked: every gradient counted; SSP({BOUND_S})'s staleness stays within (N-1)(2s+1) = {bound}")


if __name__ == "__main__":
    main()
