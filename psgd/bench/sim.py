"""`psgd bench sim`: what a simulated cluster costs this machine, by its worker count, for a fixed number of gradients.

For each N (default 1, 64, 1024) it runs one async job as a simulated cluster (psgd/sim/) that
applies G gradients in all (`--steps G / N`), its clock given (`--sim-compute`, `--sim-apply`: no
measurement, so every N runs the same time model), and times its event loop on this machine's
clock: the real seconds the simulation took, beside the gradients it computed, the events it ran
and the parameter vectors it held at once (pulled copies and gradients in flight). The cost
ratio is each N's loop seconds over N = 1's, measured in one run, interleaved over `--rounds`
(the median of each). What is SIMULATED is the runs' own clock (their updates/s, staleness);
the cost figures are real seconds of this machine.

    psgd bench sim --gradients 4096 --workers 1,64,1024 --out results/bench/sim
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path


def one(n: int, gradients: int, servers: int, out: Path, compute: str, link: str) -> dict:
    """One simulated run; what it cost and what it simulated."""
    from psgd.core import config as C  # noqa: PLC0415
    from psgd.sim.run import SimConfig, simulate  # noqa: PLC0415

    # The default model and data (psgd run's), 50,000 samples so that 1,024 batches of 32 fit; a small
    # rate and --skip-nonfinite, so that a thousand stale workers do not end the run early (this bench
    # is about what the simulation costs).
    cfg = C.validate(C.RunConfig(mode="async", workers=n, servers=servers, steps=gradients // n, eval_every=0,
                                 device="cpu", link=link, out=str(out), skip_nonfinite=True, threads=1,
                                 data=C.DataConfig(num_samples=50_000),
                                 optim=C.OptimConfig(lr=0.01, momentum=0.0)))
    s = simulate(cfg, SimConfig(compute=compute, apply="0.25ns"))
    tm = s["time_model"]
    return {"workers": n, "gradients_applied": s["global_updates"], "gradients_computed": tm["gradients_computed"],
            "events": tm["events"], "loop_s": tm["event_loop_real_s"], "peak_vectors_in_flight":
            tm["peak_vectors_in_flight"], "peak_bytes_in_flight": tm["peak_bytes_in_flight"],
            "simulated_updates_per_s": s["updates_per_s"], "simulated_staleness_mean": s["staleness"]["mean"],
            "time_model": tm["said"]}


def main(argv: list[str]) -> int:
    from psgd.core.errors import Parser, UsageError  # noqa: PLC0415

    p = Parser(prog="psgd bench sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,64,1024", help="worker counts N, comma-separated (the first is the base)")
    p.add_argument("--gradients", type=int, default=4096, help="gradients applied per run, G (each N: G / N steps)")
    p.add_argument("--servers", type=int, default=1, help="shards K")
    p.add_argument("--compute", default="5ms", help="--sim-compute of every run (the clock is given, not measured)")
    p.add_argument("--link", default="10gbit,50us", help="--link of every run (the SIMULATED network)")
    p.add_argument("--rounds", type=int, default=3, help="runs per N, interleaved; the median is reported")
    p.add_argument("--out", default="", help="write bench.json and bench.md here (e.g. results/bench/sim)")
    a = p.parse_args(argv)
    try:
        ns = [int(x) for x in a.workers.split(",")]
    except ValueError:
        raise UsageError(f"--workers takes N,N,..., got {a.workers!r}") from None
    if any(n < 1 or a.gradients % n for n in ns) or a.rounds < 1:
        raise UsageError(f"--gradients ({a.gradients}) must be a multiple of every N in {ns}, and --rounds >= 1")
    rows: dict[int, list[dict]] = {n: [] for n in ns}
    with tempfile.TemporaryDirectory(prefix="psgd-bench-sim-") as tmp:
        for r in range(a.rounds):
            for n in ns:
                rows[n].append(one(n, a.gradients, a.servers, Path(tmp) / f"n{n}-r{r}", a.compute, a.link))
                print(f"round {r + 1}/{a.rounds} N={n}: loop {rows[n][-1]['loop_s']:.2f} s", file=sys.stderr)
    table = []
    base = statistics.median(x["loop_s"] for x in rows[ns[0]])
    for n in ns:
        row = dict(rows[n][-1], loop_s=statistics.median(x["loop_s"] for x in rows[n]),
                   loop_s_each=[x["loop_s"] for x in rows[n]])
        row["cost_ratio"] = row["loop_s"] / base
        table.append(row)
    command = "psgd bench sim " + " ".join(argv)
    md = [f"# psgd bench sim\n\n`{command}`\n", "Real seconds of this machine for the simulation's event loop "
          f"(median of {a.rounds}), async, {a.gradients} gradients in all, K = {a.servers}. The simulated "
          "columns are SIMULATED, " + table[0]["time_model"] + ".\n",
          "| N | cost ratio | loop s | gradients computed | events | peak vectors in flight | "
          "SIMULATED updates/s | SIMULATED staleness |", "|---|---|---|---|---|---|---|---|"]
    md += [f"| {t['workers']} | {t['cost_ratio']:.2f} | {t['loop_s']:.2f} | {t['gradients_computed']} | "
           f"{t['events']} | {t['peak_vectors_in_flight']} | {t['simulated_updates_per_s']:,.0f} | "
           f"{t['simulated_staleness_mean']:.1f} |" for t in table]
    print("\n".join(md))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({"command": command, "rows": table}, indent=1))
        (out / "bench.md").write_text("\n".join(md) + "\n")
        (out / "command.txt").write_text(command + "\n")
    return 0
