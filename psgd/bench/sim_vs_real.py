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

With `--link RATE,LATENCY` the real runs go on a netns cluster of their own (psgd/bench/shaped.py:
K + max(N) hosts, every link shaped by the kernel to RATE and LATENCY, shard k on host k and each
worker on a host of its own, taken down after the bench) and the simulation gets the same `--link`:
its alpha-beta wire with a queue at each NIC (psgd/sim/timemodel.py) is then what it predicts, so
the law takes from the real run only what the wire does not make (`wire_law`): each step's compute
(its `compute_s`, per-worker means and spread), and as the message the software floor left once the
modelled wire time of one whole message is taken off each half of the fastest push + pull (0 at least). The
processes still share this host's cores (the cluster gives each a link, not a CPU).

    psgd bench sim-vs-real --modes sync,async,ssp --workers 2,4 --steps 40 --seeds 3 --out results/bench/sim-vs-real
    psgd bench sim-vs-real --modes sync,async --workers 2,4 --link 100mbit,1ms --out results/bench/sim-vs-real-1gbit
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


def calibrated(out: Path, s: dict, link: str = "") -> dict:
    """The time law of a finished real run (`step_law` from its step lines, `wire_law` on a shaped
    `link`) and its shards' apply per byte."""
    from psgd.core import link as link_mod  # noqa: PLC0415
    from psgd.sim.calibrate import step_law  # noqa: PLC0415
    from psgd.train.metrics import read_events  # noqa: PLC0415

    lines = read_events(out / "metrics.jsonl")
    shards = [json.loads((out / f"shard-{k}.json").read_text()) for k in range(s["servers"])]
    if link:
        wire = link_mod.parse(link)
        law = wire_law(lines, s["workers"], 8 * 4 * sum(sh["num_elements"] for sh in shards) / wire.bits_per_s
                       + wire.latency_s)
    else:
        law = step_law(lines, s["workers"])
    bytes_taken = sum(4 * sh["num_elements"] * sh["accepted"] for sh in shards)
    return dict(law, apply_s_per_byte=sum(sh["apply_s"] for sh in shards) / max(1, bytes_taken))


def wire_law(lines: list[dict], workers: int, wire_s: float) -> dict:
    """`step_law`'s fields for a run on shaped links whose wire the simulation models itself: compute
    from the step lines' `compute_s` (clock 0 left out), the message half the fastest push + pull less
    `wire_s` (one whole push's modelled wire time and latency), at least 0. ValueError when no worker
    has a step."""
    import statistics  # noqa: PLC0415

    own: dict[int, list[float]] = {w: [] for w in range(workers)}
    floor = float("inf")
    for e in lines:
        if e.get("event") == "step" and e.get("clock", 0) > 0 and e.get("rank") in own:
            own[e["rank"]].append(max(float(e["compute_s"]), 1e-9))
            floor = min(floor, float(e["push_s"]) + float(e["pull_s"]))
    own = {w: v for w, v in own.items() if v}
    if not own:
        raise ValueError("wire_law: no worker has a step line past clock 0")
    means = {w: statistics.fmean(v) for w, v in own.items()}
    mean = statistics.fmean(means.values())
    ratios = [x / means[w] for w, v in own.items() for x in v]
    return {"compute_s": mean, "speeds": tuple(mean / means[w] if w in means else 1.0 for w in range(workers)),
            "spread": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
            "message_s": max(0.0, floor / 2 - wire_s)}


def pair(cfg, out: Path, tolerance: float, cluster=None) -> dict:
    """One seed's real run and its calibrated simulation; with `cluster` (psgd/cluster/plan.py's, up),
    the real run on its shaped links (K + N hosts) and the simulation on that link."""
    from psgd.sim.run import SimConfig, simulate  # noqa: PLC0415
    from psgd.train import launch  # noqa: PLC0415

    link = cluster.link if cluster is not None else ""
    placed = dict(hosts=cfg.servers + cfg.workers, cluster=cluster.name) if link else {}
    real_cfg = dataclasses.replace(cfg, out=str(out / "real"), **placed)
    before = queues(cluster)
    real = launch.run(real_cfg)
    kernel = {**{k: v - before[k] for k, v in queues(cluster).items()}, **throttling(out / "real")}
    law = calibrated(out / "real", real, link)
    profile = out / "measured.toml"
    profile.write_text(f'message = "{law["message_s"] * 1e6:.3f}us"\n')
    sim_cfg = dataclasses.replace(cfg, out=str(out / "sim"), cpu_quota=0.0, link=link)
    sim = simulate(sim_cfg, SimConfig(compute=f"{law['compute_s'] * 1e6:.3f}us",
                                      apply=f"{law['apply_s_per_byte'] * 1e9:.6f}ns",
                                      speeds=",".join(f"{v:.6g}" for v in law["speeds"]),
                                      spread=f"{law['spread']:.6g}", profile=str(profile)))
    a, b = figures(real), figures(sim)
    return {"mode": cfg.mode, "workers": cfg.workers, "seed": cfg.seed, "real": a, "simulated": b,
            "relative_difference": {m: _rel(a[m], b[m]) for m in METRICS}, "law": law, "kernel": kernel,
            "push_bytes": 4 * real["params"],
            "time_model": sim["time_model"]["said"]}


def queues(cluster) -> dict:
    """What the kernel's shaped queues counted so far, summed over every qdisc of `cluster`'s namespaces
    (`tc -s qdisc`): packets dropped for a full queue, and `overlimits` (a packet that found the token
    bucket empty and waited); {} without a cluster."""
    import subprocess  # noqa: PLC0415

    got = {"drops": 0, "overlimits": 0}
    for ns in cluster.namespaces if cluster is not None else ():
        try:
            shown = subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show"], capture_output=True, text=True,
                                   check=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return {}  # no counters to read (no tc, or the namespace went): the report says nothing of them
        for q in json.loads(shown or "[]"):
            got = {k: v + int(q.get(k, 0)) for k, v in got.items()}
    return got if cluster is not None else {}


def throttling(out: Path) -> dict:
    """A real run's CPU quota counters (OUT/cpu-quota.json, psgd/train/cpulimit.py), over its
    processes: the share of their 100 ms periods in which the quota stopped them, and the seconds it
    held them in all, per process; {} for a run without quotas."""
    try:
        groups = json.loads((out / "cpu-quota.json").read_text())["groups"].values()
    except (OSError, ValueError, KeyError):
        return {}
    periods = sum(g["nr_periods"] for g in groups)
    return {"throttled_share": sum(g["nr_throttled"] for g in groups) / periods if periods else 0.0,
            "throttled_s": sum(g["throttled_time"] for g in groups) / 1e9 / max(1, len(groups))}


def why(rows: list[dict], burst: int | None) -> list[str]:
    """Per (mode, N), what the real run met that the model has no part for, from the kernel's own
    counters (means per run over the seeds). On shaped links (`burst`): the token bucket's `burst`
    bytes sent at the device's speed after an idle moment (the model sends every byte at the rate:
    the real run is faster where pushes are a few bursts long), and packets dropped at a full queue
    (TCP then retransmits; the model's queues never drop: the real run is slower). Under CPU quotas:
    how often the quota stopped a process for the rest of its 100 ms period (the model's compute is
    a mean and a spread, not a process parked for tens of milliseconds)."""
    import statistics  # noqa: PLC0415

    lines = []
    for key in dict.fromkeys((r["mode"], r["workers"]) for r in rows):
        group = [r for r in rows if (r["mode"], r["workers"]) == key and r.get("kernel")]
        said = []
        if group and burst is not None and "drops" in group[0]["kernel"]:
            drops = statistics.fmean(r["kernel"]["drops"] for r in group)
            waits = statistics.fmean(r["kernel"]["overlimits"] for r in group)
            said.append(f"a push of {group[0]['push_bytes']:,} bytes against a burst of {burst:,}; {drops:,.0f} "
                        f"packets dropped at the shaped queues and {waits:,.0f} held by an empty bucket per run")
        if group and "throttled_share" in group[0]["kernel"]:
            share = statistics.fmean(r["kernel"]["throttled_share"] for r in group)
            held = statistics.fmean(r["kernel"]["throttled_s"] for r in group)
            said.append(f"each process stopped by its quota in {share:.0%} of its 100 ms periods, {held:.2f} s "
                        "in all per run")
        if said:
            lines.append(f"- {key[0]} N={key[1]}: " + "; ".join(said))
    return lines


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
    p.add_argument("--link", default="", help="RATE,LATENCY: the real runs on a netns cluster with links shaped so "
                                               "(needs root), the simulation on that link (see above)")
    p.add_argument("--tolerance", type=float, default=0.15, help="relative difference that passes")
    p.add_argument("--out", default="", help="write bench.json, bench.md and command.txt here")
    a = p.parse_args(argv)
    try:
        modes, ns = a.modes.split(","), [int(x) for x in a.workers.split(",")]
        cfgs = [C.validate(C.RunConfig(mode=m, workers=n, servers=a.servers, steps=a.steps, seed=s, eval_every=0,
                                       staleness=1 if m == "ssp" else 0, device="cpu", cpu_quota=a.cpu_quota))
                for m in modes for n in ns for s in range(a.seeds)]
        name = _link_checked(a.link)
    except ValueError as e:
        raise UsageError(str(e)) from None
    cluster = _cluster(name, a.servers + max(ns), a.link)
    with tempfile.TemporaryDirectory(prefix="psgd-sim-vs-real-") as tmp, cluster as c:
        rows = [pair(cfg, Path(tmp) / f"{cfg.mode}-{cfg.workers}-{cfg.seed}", a.tolerance, c) for cfg in cfgs]
    table = summarise(rows, a.tolerance)
    command = "psgd bench sim-vs-real " + " ".join(argv)
    md = report(a, command, table, rows)
    print("\n".join(md))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({"command": command, "summary": table, "rows": rows}, indent=1))
        (out / "bench.md").write_text("\n".join(md) + "\n")
        (out / "command.txt").write_text(command + "\n")
    return 0


def _link_checked(link: str) -> str:
    """The cluster name for `--link` ("" without one); ValueError for a link that is not one."""
    if not link:
        return ""
    from psgd.bench.shaped import cluster_name  # noqa: PLC0415
    from psgd.core import link as link_mod  # noqa: PLC0415

    link_mod.parse(link)
    return cluster_name("svr", link.split(",")[0])


def _cluster(name: str, hosts: int, link: str):
    """The shaped cluster for the block (psgd/bench/shaped.py), or nothing without a link."""
    import contextlib  # noqa: PLC0415

    from psgd.bench.shaped import shaped  # noqa: PLC0415

    return shaped(name, hosts, link) if link else contextlib.nullcontext()


def report(a, command: str, table: list[dict], rows: list[dict]) -> list[str]:
    """bench.md's lines: what was compared and how, the table, and on shaped links where and why."""
    md = [f"# psgd bench sim-vs-real\n\n`{command}`\n",
          f"Real runs beside their simulation over {a.seeds} seed(s), means with 95% t intervals (SIMULATED "
          + ("columns: each seed's time model calibrated to its real run, psgd/sim/calibrate.py `step_law`: "
             "compute = a step's own time less the message floor, per-worker speeds, log-normal spread). "
             if not a.link else
             f"columns on the same link, {a.link}, as alpha-beta with a queue at each NIC; the real runs on a netns "
             "cluster whose links the kernel shapes so, sharing this host's cores. Each seed's law from its real "
             "run's compute_s (per-worker speeds, log-normal spread) and its software message floor, "
             "`wire_law`). ") +
          f"Pass: |relative difference of the means| <= {a.tolerance:.0%} for {', '.join(CHECKED)}; the "
          "paired interval of sim - real containing 0 for final_test_accuracy (2+ seeds).\n",
          "| mode | N | metric | real | SIMULATED | difference | sim - real | pass |",
          "|---|---|---|---|---|---|---|---|"]
    for t in table:
        d = t["relative_difference"]
        md.append(f"| {t['mode']} | {t['workers']} | {t['metric']} | {_ci(t['real'])} | {_ci(t['simulated'])} | "
                  f"{'' if d is None else f'{d:+.1%}'} | {_ci(t['sim_minus_real'])} | "
                  f"{'' if t['passes'] is None else 'yes' if t['passes'] else 'no'} |")
    burst = None
    if a.link:
        from psgd.cluster import plan  # noqa: PLC0415
        from psgd.core import link as link_mod  # noqa: PLC0415

        burst = plan.shaping(link_mod.parse(a.link).bits_per_s).burst
    said = why(rows, burst)
    if said:
        md += ["", "What the real runs met that the model has no part for, from the kernel's counters (shaped "
               "links: psgd/cluster/plan.py `shaping`, tbf's bucket and queue per direction of each host's link; "
               "quotas: psgd/train/cpulimit.py, CFS bandwidth control):", *said]
    return md


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
