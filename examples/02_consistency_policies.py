"""02 - the consistency policies alone: who blocks when (psgd/core/consistency.py; no network).

What it shows: the one decision a parameter shard makes, isolated. Two workers share one shard's
policy; worker 0 is fast (one tick per gradient), worker 1 slow (`--slow` ticks). Time runs in
ticks, not seconds, so the timeline is the same on every machine and every run. Each tick, first
every worker whose compute is done pushes its gradient, then every worker that needs parameters
asks the policy for a pull. The pull is asked with `timeout=0`: the real policy answers at once
or raises PullTimeout, which here means "this pull would block", and the worker tries again next
tick (a real worker would sleep in that call until the policy lets it go).

    python examples/02_consistency_policies.py --policy sync
    python examples/02_consistency_policies.py --policy async
    python examples/02_consistency_policies.py --policy ssp --staleness 1
    python examples/02_consistency_policies.py --policy all       # the three, one after the other

Sync (BSP) holds the fast worker every step; async never holds anyone and the clock gap grows
without bound; SSP(s) lets the fast worker run up to s clocks ahead of the slowest, then holds it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from psgd.core.consistency import Policy, PullTimeout, make_policy


@dataclass
class Worker:
    """One worker as the policy sees it: its clock (gradients pushed) and what it is doing."""
    rank: int
    ticks_per_gradient: int
    clock: int = 0
    base_version: int = -1   # version it pulled and computes on; -1: it needs a pull
    push_at: int = 0         # tick at which its gradient is ready
    held_since: int = -1     # tick its current pull was first held; -1: not held
    waited: int = 0          # ticks spent held by the policy
    cells: list[str] = field(default_factory=list)  # what it did each tick, for the timeline


def why_held(policy: Policy, clock: int, staleness: int) -> str:
    """The rule that holds a pull, in the policy's own terms (psgd/core/consistency.py)."""
    if policy.name == "sync":
        return f"step {clock} needs version {clock} (step {clock - 1}'s mean), the shard is at v{policy.version}"
    return f"clock {clock} - slowest clock {min(policy.clocks)} > s = {staleness}"


def tick(policy: Policy, workers: list[Worker], t: int, staleness: int) -> list[str]:
    """Play tick t, pushes first, then pulls; return one line per event."""
    lines = []
    pushed = set()
    for w in workers:
        if w.base_version >= 0 and w.push_at == t:
            pushed.add(w.rank)
            out = policy.push(w.rank, w.clock, w.base_version, torch.ones(1))
            what = (f"applied -> v{out.version}, staleness {out.staleness}" if out.applied
                    else f"buffered until all {policy.num_workers} workers pushed step {w.clock}")
            lines.append(f"{t:>4}  w{w.rank}  push c{w.clock}  computed on v{w.base_version}: {what}")
            w.clock, w.base_version = w.clock + 1, -1
    for w in workers:
        mark = "^" if w.rank in pushed else ""  # pushed its gradient at the start of this tick
        if w.base_version >= 0:
            w.cells.append("-")                # still computing
            continue
        try:
            got = policy.pull(w.rank, w.clock, read=lambda: None, timeout=0)
        except PullTimeout:
            if w.held_since < 0:
                w.held_since = t
                lines.append(f"{t:>4}  w{w.rank}  pull c{w.clock}  HELD: {why_held(policy, w.clock, staleness)}")
            w.waited += 1
            w.cells.append(mark + ".")
            continue
        held = f", held {t - w.held_since} tick(s)" if w.held_since >= 0 else ""
        lines.append(f"{t:>4}  w{w.rank}  pull c{w.clock}  -> v{got.version} (clock gap {got.clock_gap}){held}")
        w.base_version, w.push_at, w.held_since = got.version, t + w.ticks_per_gradient, -1
        w.cells.append(mark + str(w.clock))    # pulled; computes the gradient of this clock
    return lines


def play(mode: str, staleness: int, slow_ticks: int, ticks: int) -> None:
    """Run one policy for `ticks` ticks, print its events and timeline, and check its rule."""
    weights = torch.zeros(1)
    # The policy does no math: the shard hands it the optimizer step as `apply` (here: SGD, lr 0.1).
    policy = make_policy(mode, num_workers=2, apply=lambda g: weights.sub_(0.1 * g), staleness=staleness)
    workers = [Worker(0, 1), Worker(1, slow_ticks)]
    name = f"ssp(staleness={staleness})" if mode == "ssp" else mode
    print(f"policy {name}; worker 0 needs 1 tick per gradient, worker 1 needs {slow_ticks}")
    print("tick  who event")
    versions = []
    for t in range(ticks):
        for line in tick(policy, workers, t, staleness):
            print(line)
        versions.append(str(policy.version))

    def row(name: str, cells: list[str], note: str = "") -> str:
        return f"  {name:9s}" + "".join(f"{c:>4s}" for c in cells) + (f"   {note}" if note else "")

    print("\ntimeline (^: pushed its gradient; a number c: pulled, computes the gradient of clock c;")
    print("          -: still computing; .: its pull is held)")
    print(row("tick", [str(t) for t in range(ticks)]))
    for w in workers:
        print(row(f"worker {w.rank}", w.cells, f"{w.clock} gradients pushed, {w.waited} ticks held"))
    print(row("version", versions, "the shard's, at the end of the tick"))

    gaps, stale = policy.stats.max_clock_gap, dict(sorted(policy.stats.staleness.items()))
    print(f"max clock gap {gaps}; staleness per gradient (staleness: count) {stale}")

    fast, slow = workers
    # The claims, each a rule of psgd/core/consistency.py made visible.
    if mode == "sync":
        assert gaps == 0 and set(stale) <= {0}, "sync: everyone computes on the same version"
        if slow_ticks > 1 and ticks > 1:
            assert fast.waited > 0, "sync: the fast worker waits for the slow one every step"
    if mode == "async":
        assert fast.waited == 0 and slow.waited == 0, "async: a pull never blocks"
        if slow_ticks > 1 and ticks > 3:
            assert gaps > 1, "async: nothing bounds how far the fast worker runs ahead"
    if mode == "ssp":
        assert gaps <= staleness, f"SSP({staleness}) let a worker run {gaps} clocks ahead"
        assert fast.clock <= slow.clock + staleness + 1, "SSP: the fast worker's lead is bounded"
    print(f"checked: {name} kept its rule")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", choices=("sync", "async", "ssp", "all"), default="ssp",
                    help="all: the three, one after the other")
    ap.add_argument("--staleness", type=int, default=1, help="SSP's bound s on the clock gap")
    ap.add_argument("--slow", type=int, default=3, help="ticks worker 1 needs per gradient (worker 0: 1)")
    ap.add_argument("--ticks", type=int, default=12)
    args = ap.parse_args()
    if args.staleness < 0 or args.slow < 1 or args.ticks < 1:
        ap.error("--staleness must be >= 0, --slow and --ticks >= 1")
    for i, mode in enumerate(("sync", "async", "ssp") if args.policy == "all" else (args.policy,)):
        if i:
            print()
        play(mode, args.staleness, args.slow, args.ticks)


if __name__ == "__main__":
    main()
