"""`psgd bench sim-vs-real`: the simulated cluster beside the real run it models, metric by metric.

For each mode, N and seed it runs the real job (`psgd run`, real processes; with `--cpu-quota C`
each in a CPU quota of its own, so that none shares a core), then the same job `--simulate`d with
its time model calibrated to that run: a step's compute is the real workers' mean compute per
step, a shard's apply cost per byte the real shards' (shard-K.json `apply_s` over the bytes they
took), and a message's software time half the real exchange's push and pull time per step.
Side by side: staleness (mean, p50, p99), the largest clock gap, updates/s and the final
test accuracy, each with the simulation's relative difference; staleness mean and updates/s
pass within `--tolerance` (15%: issue 55's). What the table says of the simulation is measured;
its simulated columns are SIMULATED.

A skeleton of issue 55's check: one host's processes, no netns cluster points, one seed by
default; the intervals over seeds that the issue asks for are left to a suite.

    psgd bench sim-vs-real --modes sync,async,ssp --workers 2,4 --steps 40 --out results/bench/sim-vs-real
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

METRICS = ("staleness_mean", "staleness_p50", "staleness_p99", "max_clock_gap", "updates_per_s", "final_test_accuracy")
CHECKED = ("staleness_mean", "updates_per_s")


def figures(s: dict) -> dict:
    st = s["staleness"]
    return {"staleness_mean": st["mean"], "staleness_p50": st["p50"], "staleness_p99": st["p99"],
            "max_clock_gap": s["max_clock_gap"], "updates_per_s": s["updates_per_s"],
            "final_test_accuracy": s["final_test_accuracy"]}


def calibrated(out: Path, s: dict) -> tuple[str, str, str]:
    """(--sim-compute, --sim-apply, a profile's message) from a finished real run: the mean compute per
    step, the shards' apply per byte, and the exchange's own time per message (push and pull time per
    step less their bytes' share, over the step's two messages: the software the alpha-beta link lacks)."""
    steps = max(1, s["worker_steps"] / max(1, s["workers"]))
    times = s["time_breakdown_s"]
    compute = times["compute"] / steps
    message = (times["push"] + times["pull"]) / steps / 2
    shards = [json.loads((out / f"shard-{k}.json").read_text()) for k in range(s["servers"])]
    bytes_taken = sum(4 * sh["num_elements"] * sh["accepted"] for sh in shards)
    apply = sum(sh["apply_s"] for sh in shards) / max(1, bytes_taken)
    return f"{compute * 1e6:.3f}us", f"{apply * 1e9:.6f}ns", f"{message * 1e6:.3f}us"


def pair(cfg, out: Path, tolerance: float) -> dict:
    from psgd.sim.run import SimConfig, simulate  # noqa: PLC0415
    from psgd.train import launch  # noqa: PLC0415

    real_cfg = dataclasses.replace(cfg, out=str(out / "real"))
    real = launch.run(real_cfg)
    compute, apply, message = calibrated(out / "real", real)
    profile = out / "measured.toml"
    profile.write_text(f'message = "{message}"\n')
    sim_cfg = dataclasses.replace(cfg, out=str(out / "sim"), cpu_quota=0.0)
    sim = simulate(sim_cfg, SimConfig(compute=compute, apply=apply, profile=str(profile)))
    a, b = figures(real), figures(sim)
    diff = {m: (b[m] - a[m]) / a[m] if a[m] else (0.0 if b[m] == a[m] else None)
            for m in METRICS if a[m] is not None and b[m] is not None}
    ok = {m: diff.get(m) is not None and abs(diff[m]) <= tolerance for m in CHECKED}
    return {"mode": cfg.mode, "workers": cfg.workers, "seed": cfg.seed, "real": a, "simulated": b,
            "relative_difference": diff, "within_tolerance": ok, "sim_compute": compute, "sim_apply": apply,
            "sim_message": message,
            "time_model": sim["time_model"]["said"]}


def main(argv: list[str]) -> int:
    import tempfile  # noqa: PLC0415

    from psgd.core import config as C  # noqa: PLC0415
    from psgd.core.errors import Parser, UsageError  # noqa: PLC0415

    p = Parser(prog="psgd bench sim-vs-real", description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="sync,async", help="PS modes, comma-separated (ssp runs with --staleness 1)")
    p.add_argument("--workers", default="2,4", help="worker counts N, comma-separated")
    p.add_argument("--servers", type=int, default=1, help="shards K")
    p.add_argument("--steps", type=int, default=40, help="--steps of every run")
    p.add_argument("--seeds", type=int, default=1, help="seeds per point (0..S-1)")
    p.add_argument("--cpu-quota", type=float, default=0.0, help="the real runs' --cpu-quota (0: shared cores)")
    p.add_argument("--tolerance", type=float, default=0.15, help="relative difference that passes")
    p.add_argument("--out", default="", help="write bench.json, bench.md and command.txt here")
    a = p.parse_args(argv)
    try:
        modes, ns = a.modes.split(","), [int(x) for x in a.workers.split(",")]
        cfgs = [C.validate(C.RunConfig(mode=m, workers=n, servers=a.servers, steps=a.steps, seed=s, eval_every=0,
                                       staleness=1 if m == "ssp" else 0, device="cpu", cpu_quota=a.cpu_quota))
                for m in modes for n in ns for s in range(a.seeds)]
    except ValueError as e:
        raise UsageError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="psgd-sim-vs-real-") as tmp:
        rows = [pair(cfg, Path(tmp) / f"{cfg.mode}-{cfg.workers}-{cfg.seed}", a.tolerance) for cfg in cfgs]
    command = "psgd bench sim-vs-real " + " ".join(argv)
    md = [f"# psgd bench sim-vs-real\n\n`{command}`\n",
          f"Real runs beside their simulation (SIMULATED columns: the time model calibrated to each real run). "
          f"Pass: |relative difference| <= {a.tolerance:.0%} for {', '.join(CHECKED)}.\n",
          "| mode | N | seed | metric | real | SIMULATED | difference | pass |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for m in METRICS:
            d = r["relative_difference"].get(m)
            md.append(f"| {r['mode']} | {r['workers']} | {r['seed']} | {m} | {_num(r['real'][m])} | "
                      f"{_num(r['simulated'][m])} | {'' if d is None else f'{d:+.1%}'} | "
                      f"{'yes' if r['within_tolerance'].get(m) else 'no' if m in CHECKED else ''} |")
    print("\n".join(md))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
        (out / "bench.md").write_text("\n".join(md) + "\n")
        (out / "command.txt").write_text(command + "\n")
    return 0


def _num(x) -> str:
    return "" if x is None else f"{x:,.3g}" if isinstance(x, float) else str(x)
