"""`psgd bench sim-vs-real`: the simulated cluster beside the real run it models, metric by metric, over seeds.

For each mode, N and seed it runs the real job (`psgd run`, real processes; with `--cpu-quota C`
each in a CPU quota of its own, so that none shares a core), then the same job `--simulate`d with
its time model calibrated to that run (psgd/sim/calibrate.py `step_law`): a step's own time
(compute + push + pull, from the real step lines) less the run's message floor becomes the model's
compute, each worker's mean its speed and the per-step variation a log-normal spread (its CV); the
message is the floor; a shard's apply cost per byte is the real shards' (shard-K.json `apply_s`
over the bytes they took). Side by side: staleness (mean, p50, p99), the largest clock gap,
updates/s and the final test accuracy, per seed and over seeds (the mean of each side with its 95%
t interval, the relative difference of the means, and for accuracy the paired interval of sim -
real). Pass: staleness mean and updates/s within `--tolerance` (15%: issue 55's); accuracy's
interval containing 0 (with 2 or more seeds). What the table says of the simulation is measured;
its simulated columns are SIMULATED.

One host's processes, no netns cluster points.

    psgd bench sim-vs-real --modes sync,async,ssp --workers 2,4 --steps 40 --seeds 3 --out results/bench/sim-vs-real
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


def calibrated(out: Path, s: dict) -> dict:
    """The time law of a finished real run (`step_law`, from its step lines) and its shards' apply per byte."""
    from psgd.sim.calibrate import step_law  # noqa: PLC0415
    from psgd.train.metrics import read_events  # noqa: PLC0415

    law = step_law(read_events(out / "metrics.jsonl"), s["workers"])
    shards = [json.loads((out / f"shard-{k}.json").read_text()) for k in range(s["servers"])]
    bytes_taken = sum(4 * sh["num_elements"] * sh["accepted"] for sh in shards)
    return dict(law, apply_s_per_byte=sum(sh["apply_s"] for sh in shards) / max(1, bytes_taken))


def pair(cfg, out: Path, tolerance: float) -> dict:
    from psgd.sim.run import SimConfig, simulate  # noqa: PLC0415
    from psgd.train import launch  # noqa: PLC0415

    real_cfg = dataclasses.replace(cfg, out=str(out / "real"))
    real = launch.run(real_cfg)
    law = calibrated(out / "real", real)
    profile = out / "measured.toml"
    profile.write_text(f'message = "{law["message_s"] * 1e6:.3f}us"\n')
    sim_cfg = dataclasses.replace(cfg, out=str(out / "sim"), cpu_quota=0.0)
    sim = simulate(sim_cfg, SimConfig(compute=f"{law['compute_s'] * 1e6:.3f}us",
                                      apply=f"{law['apply_s_per_byte'] * 1e9:.6f}ns",
                                      speeds=",".join(f"{v:.6g}" for v in law["speeds"]),
                                      spread=f"{law['spread']:.6g}", profile=str(profile)))
    a, b = figures(real), figures(sim)
    return {"mode": cfg.mode, "workers": cfg.workers, "seed": cfg.seed, "real": a, "simulated": b,
            "relative_difference": {m: _rel(a[m], b[m]) for m in METRICS}, "law": law,
            "time_model": sim["time_model"]["said"]}


def _rel(real, sim) -> float | None:
    if real is None or sim is None:
        return None
    return (sim - real) / real if real else (0.0 if sim == real else None)


def summarise(rows: list[dict], tolerance: float) -> list[dict]:
    """Per (mode, N) and metric, over seeds: each side's mean and 95% interval, the relative difference
    of the means, the paired interval of sim - real, and whether it passes (see the module docstring)."""
    out = []
    for key in dict.fromkeys((r["mode"], r["workers"]) for r in rows):
        group = [r for r in rows if (r["mode"], r["workers"]) == key]
        for m in METRICS:
            pairs = [(r["real"][m], r["simulated"][m]) for r in group
                     if r["real"][m] is not None and r["simulated"][m] is not None]
            if not pairs:
                continue
            real, sim = [p[0] for p in pairs], [p[1] for p in pairs]
            rc, sc, dc = mean_ci(real), mean_ci(sim), mean_ci([b - a for a, b in pairs])  # paired by seed
            rel = _rel(rc["estimate"], sc["estimate"])
            ok = (rel is not None and abs(rel) <= tolerance) if m in CHECKED else \
                (dc["lo"] <= 0.0 <= dc["hi"] if m == "final_test_accuracy" and dc["n"] > 1 else None)
            out.append({"mode": key[0], "workers": key[1], "metric": m, "seeds": len(pairs), "real": rc,
                        "simulated": sc, "relative_difference": rel, "sim_minus_real": dc, "passes": ok})
    return out


def main(argv: list[str]) -> int:
    import tempfile  # noqa: PLC0415

    from psgd.core import config as C  # noqa: PLC0415
    from psgd.core.errors import Parser, UsageError  # noqa: PLC0415

    p = Parser(prog="psgd bench sim-vs-real", description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="sync,async", help="PS modes, comma-separated (ssp runs with --staleness 1)")
    p.add_argument("--workers", default="2,4", help="worker counts N, comma-separated")
    p.add_argument("--servers", type=int, default=1, help="shards K")
    p.add_argument("--steps", type=int, default=40, help="--steps of every run")
    p.add_argument("--seeds", type=int, default=3, help="seeds per point (0..S-1); intervals need 2 or more")
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
    table = summarise(rows, a.tolerance)
    command = "psgd bench sim-vs-real " + " ".join(argv)
    md = [f"# psgd bench sim-vs-real\n\n`{command}`\n",
          f"Real runs beside their simulation over {a.seeds} seed(s), means with 95% t intervals (SIMULATED "
          "columns: each seed's time model calibrated to its real run, psgd/sim/calibrate.py `step_law`: "
          "compute = a step's own time less the message floor, per-worker speeds, log-normal spread). "
          f"Pass: |relative difference of the means| <= {a.tolerance:.0%} for {', '.join(CHECKED)}; the "
          "paired interval of sim - real containing 0 for final_test_accuracy (2+ seeds).\n",
          "| mode | N | metric | real | SIMULATED | difference | sim - real | pass |",
          "|---|---|---|---|---|---|---|---|"]
    for t in table:
        d = t["relative_difference"]
        md.append(f"| {t['mode']} | {t['workers']} | {t['metric']} | {_ci(t['real'])} | {_ci(t['simulated'])} | "
                  f"{'' if d is None else f'{d:+.1%}'} | {_ci(t['sim_minus_real'])} | "
                  f"{'' if t['passes'] is None else 'yes' if t['passes'] else 'no'} |")
    print("\n".join(md))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({"command": command, "summary": table, "rows": rows}, indent=1))
        (out / "bench.md").write_text("\n".join(md) + "\n")
        (out / "command.txt").write_text(command + "\n")
    return 0


def mean_ci(values: list[float], level: float = 0.95) -> dict:
    """The mean over seeds with its Student t interval (as psgd/lab/stats.py `mean_ci`, which this
    layer may not import); one value: no interval (nan ends)."""
    import statistics  # noqa: PLC0415

    from scipy.stats import t  # noqa: PLC0415

    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return {"estimate": mean, "lo": float("nan"), "hi": float("nan"), "n": n}
    half = t.ppf(0.5 + level / 2, n - 1) * statistics.stdev(values) / n ** 0.5
    return {"estimate": mean, "lo": float(mean - half), "hi": float(mean + half), "n": n}


def _ci(i: dict) -> str:
    """mean [lo, hi] (the estimate alone with one seed)."""
    est, lo, hi = i["estimate"], i["lo"], i["hi"]
    if i["n"] <= 1 or lo != lo or hi != hi:
        return f"{est:,.3g}"
    return f"{est:,.3g} [{lo:,.3g}, {hi:,.3g}]"
