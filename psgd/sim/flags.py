"""`psgd run`'s simulation flags (--simulate, --sim-compute, --sim-speeds, --sim-spread, --sim-apply, --sim-profile) and
what `psgd run --simulate` does with them. No torch at import: the CLI imports this to build its parser.

    psgd run --mode async --workers 1024 --servers 4 --steps 4 --simulate --sim-compute 20ms --link 25gbit,5us
"""

from __future__ import annotations

import argparse
import sys

from psgd.core.errors import UsageError
from psgd.sim.run import SimConfig

FLAGS = ("sim_compute", "sim_speeds", "sim_spread", "sim_apply", "sim_profile")


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated cluster (psgd/sim/)")
    g.add_argument("--simulate", action="store_true",
                   help="run the job as a SIMULATED cluster: N virtual workers and K real shards in this one "
                        "process on a virtual clock (PS modes); every time it reports is the time model's")
    g.add_argument("--sim-compute", default="", metavar="DURATION",
                   help="a step's compute, e.g. 120ms, or per sample, e.g. 40us/sample; without it the profile's, "
                        "else measured here first in one process on one thread (default: measured)")
    g.add_argument("--sim-speeds", default="", metavar="S,S,...|lognormal:SIGMA",
                   help="each worker's device speed (its compute takes the step's time / speed), repeated over the "
                        "ranks, or drawn log-normal (default: all 1)")
    g.add_argument("--sim-spread", default="", metavar="CV",
                   help="how much a worker's step time varies from step to step: a log-normal factor of mean 1 "
                        "and this coefficient of variation, e.g. 0.3 (default: the profile's, else 0)")
    g.add_argument("--sim-apply", default="", metavar="DURATION",
                   help="a shard's CPU per byte of a push, e.g. 0.25ns; without it the profile's, else measured here "
                        "(default: measured)")
    g.add_argument("--sim-profile", default="", metavar="FILE.toml",
                   help="a hardware profile: compute, speeds, link, apply, message (psgd/sim/timemodel.py); "
                        "the flags win over it")


def sim_config(args: argparse.Namespace) -> SimConfig | None:
    """The simulation's settings when --simulate was given, else None (UsageError for a --sim-* alone)."""
    if not getattr(args, "simulate", False):
        given = [f"--{f.replace('_', '-')}" for f in FLAGS if getattr(args, f, "")]
        if given:
            raise UsageError(f"{', '.join(given)} set(s) the simulated cluster's time model: add --simulate")
        return None
    if getattr(args, "resume", ""):
        raise UsageError("--simulate runs a job from its start: --resume continues a real one")
    return SimConfig(compute=args.sim_compute, speeds=args.sim_speeds, spread=args.sim_spread, apply=args.sim_apply,
                     profile=args.sim_profile)


def run_simulated(cfg, sim: SimConfig, report) -> int:
    """`psgd run --simulate` on `cfg` as the pre-flight left it (checked by `run.check` before, its
    folder prepared): the run folder as a real run's; `report(summary, out)` prints its summary
    line (the CLI's), after a line that says SIMULATED and what its clock is made of."""
    from psgd.sim import run  # noqa: PLC0415
    from psgd.train.supervise import RunFailed  # noqa: PLC0415

    try:
        summary = run.simulate(cfg, sim, prepared=True)
    except RunFailed as e:  # psgd/sim/cluster.py `Stalled`
        print(f"psgd run: failed: {e}", file=sys.stderr)
        return 1
    print(summary["time_model"]["said"])
    report(summary, cfg.out)
    return 0
