"""`psgd bench cluster`: E4 and E10 on kernel-shaped links, beside the Python pacer and the cost model.

Contract: for each rate in `--rates` it makes a cluster of its own (`psgd cluster up --hosts
max(N)+1 --link RATE,LATENCY --name PREFIX<rate>`, psgd/cluster/netns.py) and always takes it down
again, also on a failure, Ctrl-C or SIGTERM; on it, it
- measures the link: one raw TCP stream h1 -> h0 (psgd/cluster/probe.py), against the rate tbf was given;
- calibrates the cost model across it: `psgd bench calibrate --cluster --shard-host h0` run on h1
  (psgd's own push / pull through both hosts' shaped links: alpha, beta, the shard's apply; compute
  per sample), OUT/calibration-<rate>.json;
- runs E4's configurations, those of `psgd bench scaling` (sync PS with one shard for every N in
  `--workers`, the hand-written ring for N >= 2, the wide MLP of `--width`), and gloo's own
  all-reduce beside the ring, with `psgd run --hosts` (the shard on h0 and worker r on h(r+1); ring
  rank r on h r), each PS run followed by the same run on loopback under the pacer (`--link
  RATE,LATENCY`; the pacer paces psgd's PS sockets only, so no all-reduce there);
- runs E10's: sync PS at N = 1 and max(N), every worker sleeping `--compute-ms` per step (the
  straggler delay on every rank, as experiments/e10_link.toml emulates an accelerator's compute),
  on the cluster and under the pacer;
and once E10 on loopback without pacing, and (`--ceiling`) the goodput of an unshaped veth pair (the
fastest link the cores can drive here) and of a link at each of `--probe-rates` (a raw TCP stream
only: rates at or above that ceiling measure the CPU, not the link). Per run, from its own
metrics (`scaling.measure`): step_s, updates_per_s, samples_per_s, busiest_bytes (per step, in + out of the
busiest process: the shard, or a ring rank), utilisation = busiest_bytes x 8 / step_s / rate (1.0:
the busiest host's link busy in one direction all the time: a sync step pushes, then pulls), on the
cluster wire_bytes (what the kernel counted on h0's eth0 during the whole run: start-up and headers
included), and the cost model's step (psgd/core/costmodel.py) as the higher of two floors, `bound`
naming it: predicted_wire_s, its cluster form (a CPU and a full-duplex link per host) from that
rate's calibration, and predicted_cpu_s, its one-host form (every process on these cores) from a
calibration on loopback made first (OUT/calibration-loopback.json, or `--calibration`): the cluster
gives each process a link of its own, not a CPU. The same prediction stands beside the pacer's row.
Writes OUT/cluster.csv (every run, rewritten after each), OUT/links.csv, OUT/cluster.md (the three
side by side with ratios, E10's speedups, the links), OUT/cluster.png and OUT/command.txt (the
command, date, machine and code commit: psgd/bench/record.py). Needs root. Figures only; nothing
asserts a speed. The clusters, their calibration and the cost model on them are psgd/bench/shaped.py's
(shared with `psgd bench utilisation`).

    psgd bench cluster                                          # about 6 minutes on 2 cores
    psgd bench cluster --rates 1gbit --workers 1,2 --steps 4 --e10-steps 4 --no-ceiling   # a look
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from psgd.bench import record, scaling
from psgd.bench.record import provenance, write_csv
from psgd.bench.shaped import (
    BenchFailed,
    add_cluster_flags,
    calibration,
    check_rates,
    cluster_name,
    host_calibration,
    machines,
    shaped,
)
from psgd.bench.transport import parse_int_list
from psgd.cluster import netns, probe
from psgd.core import costmodel as cm
from psgd.core import link as link_mod
from psgd.core import palette
from psgd.core.config import RunConfig

CONFIGS = {"ps": "PS, 1 shard", "ps2": "PS, 2 shards", "ring": "ring (hand-written)", "gloo": "all-reduce (gloo)"}
FIELDS = ["rate", "experiment", "config", "round", "where", "mode", "workers", "shards", "status", "step_s",
          "updates_per_s", "samples_per_s", "compute_s", "comm_s", "wait_s", "busiest_bytes", "busiest", "utilisation",
          "wire_bytes", "predicted_s", "bound", "predicted_wire_s", "predicted_cpu_s", "params", "note"]
LINK_FIELDS = ["rate", "setting_bits", "goodput_bits", "goodput_over_setting", "psgd_bits", "psgd_over_setting"]


def predict(row: dict, ms: dict[str, cm.Machine], work: cm.Workload, compute_ms: float) -> dict:
    """predicted_wire_s, predicted_cpu_s and predicted_s (the higher: `bound` says which) of a row;
    on loopback the one-host form alone. E10's emulated compute is a sleep: added, never shared."""
    w = dataclasses.replace(work, params=int(row["params"]), batch=int(row.get("batch") or work.batch))
    mode, n, k = row["mode"], int(row["workers"]), max(1, int(row["shards"] or 1))
    delay = compute_ms / 1e3 if row["experiment"] == "E10" else 0.0
    cpu = cm.step_time(mode, n, k, ms["cpu"], w).total_s + delay
    if row["where"] == "loopback":
        return {"predicted_cpu_s": cpu, "predicted_s": cpu, "bound": "CPU"}
    wire = cm.step_time(mode, n, k, ms["ring" if mode == "ring" else "ps"], w).total_s + delay
    return {"predicted_wire_s": wire, "predicted_cpu_s": cpu, "predicted_s": max(wire, cpu),
            "bound": "wire" if wire >= cpu else "CPU"}


def plans(a: argparse.Namespace, runs: Path) -> list[tuple[str, str, str, RunConfig]]:
    """(experiment, config, name, loopback config) of every run: E4's are `psgd bench scaling`'s (sync
    PS, the hand-written ring), plus gloo's own all-reduce beside the ring; E10's are E4's PS ones
    with the emulated compute."""
    ns = argparse.Namespace(workers=a.workers, shards=a.shards, transports=["tcp"], overlap=False,
                            include_ring=True, link="", steps=a.steps, batch_size=a.batch_size, width=a.width)
    out = []
    for cfg in scaling.configs(ns, runs):
        if isinstance(cfg, RunConfig):
            ring = cfg.mode == "allreduce"
            config = "ring" if ring else "ps" if cfg.servers == 1 else f"ps{cfg.servers}"
            out.append(("E4", config, Path(cfg.out).name, cfg))
            if ring:
                out.append(("E4", "gloo", f"gloo-n{cfg.workers}", dataclasses.replace(cfg, allreduce_impl="library")))
    ps = {cfg.workers: cfg for _, config, _, cfg in out if config == "ps"}
    for n in sorted({min(a.workers), max(a.workers)}):
        cfg = dataclasses.replace(ps[n], steps=a.e10_steps, straggler=tuple((r, a.compute_ms) for r in range(n)))
        out.append(("E10", "ps", f"e10-n{n}", cfg))
    return out


def run_row(cfg: RunConfig, rate: str, experiment: str, config: str, where: str, retries: int) -> dict:
    row = scaling.run_one(cfg, retries)
    row.update(rate=rate, experiment=experiment, config=config, where=where)
    if row["status"] == "ok" and rate:
        row["utilisation"] = row["busiest_bytes"] * 8 / row["step_s"] / link_mod.parse(rate).bits_per_s
    return row


def run_rate(a: argparse.Namespace, rate: str, host: dict, out: Path, runs: Path, rows: list[dict],
             links: list[dict], save) -> None:
    lk = f"{rate},{a.latency}"
    hosts = max(a.workers) + max(a.shards)   # every shard and every worker on a host of its own
    with shaped(cluster_name(a.name, rate), hosts, lk) as c:
        bits = link_mod.parse(rate).bits_per_s
        got, seconds = probe.goodput(c, "h1", "h0", max(16 << 20, int(bits / 8 * a.probe_s)) & ~((1 << 20) - 1))
        cal = calibration(out / f"calibration-{rate}.json", a, c)
        psgd_bits = 8 / cal["machine"]["beta_s_per_byte"]
        links.append({"rate": rate, "setting_bits": bits, "goodput_bits": got * 8 / seconds,
                      "goodput_over_setting": got * 8 / seconds / bits, "psgd_bits": psgd_bits,
                      "psgd_over_setting": psgd_bits / bits})
        print(f"{rate}: raw TCP {got * 8 / seconds / 1e6:.0f} Mbit/s, psgd push/pull "
              f"{8 / cal['machine']['beta_s_per_byte'] / 1e6:.0f} Mbit/s", flush=True)
        ms = machines(cal, host, link_mod.parse(lk).latency_s, got * 8 / seconds)
        work = cm.workload_from_dict(cal["workload"])
        # Rounds repeat E4's kernel runs, interleaved (every config once per round), so each point has
        # a spread; the pacer's runs and E10's are made in the first round only.
        todo_plans = [(rnd, *p) for rnd in range(a.rounds) for p in plans(a, runs / rate)
                      if rnd == 0 or p[0] == "E4"]
        for rnd, experiment, config, name, cfg in todo_plans:
            ring = cfg.mode == "allreduce"
            tag = f"-r{rnd}" if a.rounds > 1 else ""
            on = dataclasses.replace(cfg, hosts=cfg.workers if ring else cfg.workers + cfg.servers, cluster=c.name,
                                     out=str(runs / rate / "kernel" / (name + tag)))
            before = probe.wire_bytes(c, "h0")
            row = run_row(on, rate, experiment, config, "kernel", a.retries)
            row["wire_bytes"] = probe.wire_bytes(c, "h0") - before
            paced = dataclasses.replace(cfg, link=lk, out=str(runs / rate / "pacer" / name))
            todo = [row] if ring or rnd > 0 else [row, run_row(paced, rate, experiment, config, "pacer", a.retries)]
            for r in todo:
                r["round"] = rnd
                if r["status"] == "ok":
                    r.update(predict(r, ms, work, a.compute_ms))
                rows.append(r)
                print(f"{rate} {experiment} {r['where']:<6} {CONFIGS[config]} N={r['workers']}: "
                      + (f"{r['step_s']:.3f} s/step, model {r['predicted_s']:.3f}" if r["status"] == "ok"
                         else r["status"]), flush=True)
            save()


def ok(rows: list[dict], **match) -> dict | None:
    for r in rows:
        if r["status"] == "ok" and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def speedup(rows: list[dict], lo: int, hi: int, **match) -> float:
    a, b = ok(rows, experiment="E10", workers=lo, **match), ok(rows, experiment="E10", workers=hi, **match)
    return b["samples_per_s"] / a["samples_per_s"] if a and b else float("nan")


def report(rows: list[dict], links: list[dict], ceiling: float | None, a: argparse.Namespace) -> str:
    """The markdown tables: E4's three side by side, E10's speedups, the links."""
    f = "{:.3f}".format
    lines = [f"E4, seconds per step (wide MLP width {a.width}, batch {a.batch_size} per worker, sync, latency "
             f"{a.latency}): kernel = `psgd run --hosts` on the shaped cluster, pacer = the same on loopback under "
             "`--link`, model = the cost model's higher floor (bound): the wire (its cluster form, calibrated across "
             "that link) or the CPU (its one-host form: 2 cores for every process)", "",
             "| rate | config | N | kernel | pacer | model | bound | kernel / model | pacer / model | kernel / pacer "
             "| use, kernel | use, pacer | busiest MB/step |", "|" + "---|" * 13]
    errors: dict[str, list[float]] = {}
    for rate in a.rates:
        for config, label in CONFIGS.items():
            for n in a.workers:
                k, p = ok(rows, rate=rate, experiment="E4", where="kernel", config=config, workers=n), \
                    ok(rows, rate=rate, experiment="E4", where="pacer", config=config, workers=n)
                if not k:
                    continue
                m = k["predicted_s"]
                errors.setdefault(f"{rate} {config}", []).append(k["step_s"] / m - 1)
                dash = "—"
                cells = [rate, label, n, f(k["step_s"]), f(p["step_s"]) if p else dash, f(m), k["bound"],
                         f"{k['step_s'] / m:.2f}", f"{p['step_s'] / m:.2f}" if p else dash,
                         f"{k['step_s'] / p['step_s']:.2f}" if p else dash, f"{k['utilisation']:.2f}",
                         f"{p['utilisation']:.2f}" if p else dash, f"{k['busiest_bytes'] / 1e6:.1f}"]
                lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "Kernel against the model, E4: " + "; ".join(
        f"{key}: {min(e):+.0%} to {max(e):+.0%}" for key, e in errors.items())]
    lo, hi = min(a.workers), max(a.workers)
    lines += ["", f"E10, speedup N={lo} -> N={hi} (samples/s; sync PS, {a.compute_ms:g} ms emulated compute per step "
              f"on every rank)", "", "| link | kernel | pacer | model |", "|---|---|---|---|"]

    def model_speedup(**match) -> float:
        x, y = (ok(rows, experiment="E10", workers=n, **match) for n in (lo, hi))
        return x["predicted_s"] / y["predicted_s"] * hi / lo if x and y else float("nan")

    for rate in a.rates:
        lines.append(f"| {rate} | {speedup(rows, lo, hi, rate=rate, where='kernel'):.2f} | "
                     f"{speedup(rows, lo, hi, rate=rate, where='pacer'):.2f} | "
                     f"{model_speedup(rate=rate, where='kernel'):.2f} |")
    lines += ["", f"On loopback without pacing: {speedup(rows, lo, hi, where='loopback'):.2f} (the model's one-host "
              f"form: {model_speedup(where='loopback'):.2f})."]
    lines += ["", "Links: one raw TCP stream h1 -> h0, and psgd's push / pull across it (1 / beta of the calibration)",
              "", "| setting | raw TCP, Mbit/s | / setting | psgd push/pull, Mbit/s | / setting |",
              "|---|---|---|---|---|"]
    lines += [f"| {x['rate']} | {x['goodput_bits'] / 1e6:.0f} | {x['goodput_over_setting']:.2f} | "
              + (f"{x['psgd_bits'] / 1e6:.0f} | {x['psgd_over_setting']:.2f} |" if "psgd_bits" in x else "— | — |")
              for x in links]
    if ceiling:
        lines.append(f"| unshaped veth | {ceiling / 1e6:.0f} | — | — | — |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], a: argparse.Namespace, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("samples/s", lambda r: r["samples_per_s"], lambda r: r["global_batch"] / r["predicted_s"]),
              ("MB per step through the busiest host's link", lambda r: r["busiest_bytes"] / 1e6, None),
              ("that link's use: bytes x 8 / step / rate", lambda r: r["utilisation"], None))
    fig, axes = plt.subplots(len(panels), len(a.rates), figsize=(4.6 * len(a.rates), 10), squeeze=False)
    for j, rate in enumerate(a.rates):
        for (title, value, model), ax in zip(panels, (axes[i][j] for i in range(len(panels))), strict=True):
            for config, label in CONFIGS.items():
                mode = {"ring": "ring", "gloo": "library"}.get(config, "ps")
                # The 2-shard PS in a variant colour and marker (as E4's samples_per_s.png): not the 1-shard PS's.
                variant = 3 if config == "ps2" else -1
                for where, dash in (("kernel", "-"), ("pacer", "--"), ("model", ":")):
                    pts = [(n, r) for n in a.workers if (r := ok(rows, rate=rate, experiment="E4", config=config,
                                                                 where="kernel" if where == "model" else where,
                                                                 workers=n))]
                    if not pts or (where == "model" and (model is None or config == "gloo")):
                        continue  # one model line for the all-reduce: the ring's and gloo's are the same
                    name = "all-reduce" if where == "model" and config == "ring" else label
                    ax.plot([n for n, _ in pts], [(model if where == "model" else value)(r) for _, r in pts],
                            color=palette.color(mode, variant), marker=palette.marker(mode, variant), linestyle=dash,
                            label=f"{name}, {where}")
            ax.set_title(f"{rate}: {title}", fontsize=9)
            ax.set_xlabel("workers N")
            ax.set_xticks(a.workers)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6)
    # Wrapped to the figure's width (one rate is 4.6 inches: one line of it was cut at both edges).
    title = (f"E4 on kernel-shaped links (psgd cluster, solid) vs the Python pacer on loopback (dashed) vs the "
             f"cost model (dotted); wide MLP width {a.width}, sync; 2 CPU cores shared by every host")
    fig.suptitle(textwrap.fill(title, int(13 * 4.6 * len(a.rates))), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return fig


def _parser() -> argparse.ArgumentParser:
    """The flags of `psgd bench cluster` (a psgd.core.errors.Parser, not yet parsed)."""
    from psgd.core.errors import Parser

    p = Parser(prog="psgd bench cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1gbit,2gbit,5gbit,10gbit", help="link rates, one cluster each")
    p.add_argument("--latency", default="200us", help="one-way latency of every link (psgd's pacer adds it)")
    p.add_argument("--workers", default="1,2,4", help="worker counts N (the cluster has max(N) + max(K) hosts)")
    p.add_argument("--shards", default="1", help="E4: PS shard counts K, each shard on a host of its own (1,2: the "
                   "one-shard PS and a sharded one beside it)")
    p.add_argument("--rounds", type=int, default=1, help="E4: every kernel run this many times, interleaved, so "
                   "each point has a spread (the verdict's interval is over rounds)")
    p.add_argument("--width", type=int, default=1024, help="wide_mlp width (E4's and E10's: about 2.1M parameters)")
    p.add_argument("--steps", type=int, default=10, help="E4: updates per run (the first and the last not timed)")
    p.add_argument("--e10-steps", type=int, default=12, help="E10: updates per run (the first and the last not "
                   "timed)")
    p.add_argument("--compute-ms", type=int, default=30,
                   help="E10: emulated compute per step on every rank (whole ms, as --straggler takes them)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    add_cluster_flags(p, name="bc", repeat=5)
    p.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                   help="first measure an unshaped veth pair: the fastest link the cores can drive")
    p.add_argument("--probe-rates", default="25gbit",
                   help="with --ceiling: rates measured with the raw TCP probe only (no runs), to show what the "
                        "cores cannot drive")
    p.add_argument("--out", default=record.scratch("bench/cluster"), help="folder for the CSVs, table, plot and "
                   "command (default: %(default)s, git-ignored)")
    p.add_argument("--runs", default="results/runs/bench-cluster", help="folder for the runs themselves")
    return p


def _parse(argv: list[str]) -> argparse.Namespace:
    """The flags of `argv`, the lists split and every value checked; UsageError on a bad one."""
    from psgd.core.errors import UsageError

    a = _parser().parse_args(argv)
    a.workers = parse_int_list(a.workers, "--workers")
    a.shards = parse_int_list(a.shards, "--shards")
    a.rates = [r.strip().lower() for r in a.rates.split(",") if r.strip()]
    a.probe_rates = [r.strip().lower() for r in a.probe_rates.split(",") if r.strip()] if a.ceiling else []
    try:
        check_rates(a.rates + a.probe_rates, a.latency, a.name)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if a.rounds < 1 or min(a.shards) < 1:
        raise UsageError("--rounds and every --shards count must be >= 1")
    if not a.rates or max(a.workers) < 2 or a.steps < 3 or a.e10_steps < 3 or a.width < 1 or a.batch_size < 1:
        raise UsageError("give --rates, --workers up to 2 or more, --steps and --e10-steps >= 3, --width and "
                         "--batch-size >= 1")
    return a


def _ceiling(a: argparse.Namespace, links: list[dict]) -> float | None:
    """With --ceiling: the veth pair's raw TCP bits/s (each --probe-rates rate's into `links`); else None."""
    ceiling = None
    if a.ceiling:
        for rate in ["", *a.probe_rates]:
            with shaped(cluster_name(a.name, rate or "veth"), 2, rate) as c:
                got, seconds = probe.goodput(c, "h1", "h0", 512 << 20)
            bits = got * 8 / seconds
            if rate:
                setting = link_mod.parse(rate).bits_per_s
                links.append({"rate": f"{rate} (probe only)", "setting_bits": setting, "goodput_bits": bits,
                              "goodput_over_setting": bits / setting})
            ceiling = ceiling or bits
            print(f"{rate or 'unshaped veth pair'}: {bits / 1e6:.0f} Mbit/s (raw TCP)", flush=True)
    return ceiling


def _measure(a: argparse.Namespace, out: Path, runs: Path, rows: list[dict], links: list[dict],
             save: Callable[[], None]) -> float | None:
    """The ceiling, E10 on the loopback, every rate's runs into `rows` and `links`; returns the ceiling."""
    # Appended as they are measured, not returned: main saves what a failure midway leaves.
    ceiling = _ceiling(a, links)
    host = host_calibration(out, a)
    for name, cfg in [(name, cfg) for e, _, name, cfg in plans(a, runs / "loopback") if e == "E10"]:
        row = run_row(dataclasses.replace(cfg, out=str(runs / "loopback" / name)), "", "E10", "ps", "loopback",
                      a.retries)
        if row["status"] == "ok":
            row.update(predict(row, {"cpu": cm.machine_from_dict(host["machine"])},
                               cm.workload_from_dict(host["workload"]), a.compute_ms))
        rows.append(row)
    for rate in a.rates:
        run_rate(a, rate, host, out, runs, rows, links, save)
    return ceiling


def _finish(rows: list[dict], links: list[dict], ceiling: float | None, a: argparse.Namespace, out: Path) -> None:
    """After every run: OUT/cluster.md and OUT/cluster.png, the end of OUT/command.txt, the table printed."""
    for r in rows:
        r["global_batch"] = int(r["workers"]) * a.batch_size
    (out / "cluster.md").write_text(report(rows, links, ceiling, a))
    plot(rows, a, out / "cluster.png")
    with open(out / "command.txt", "a") as f:
        f.write(f"# finished {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (load average "
                f"{os.getloadavg()[0]:.1f}); unshaped veth pair: "
                + (f"{ceiling / 1e6:.0f} Mbit/s raw TCP\n" if ceiling else "not measured\n"))
    print((out / "cluster.md").read_text())
    print(f"wrote {out / 'cluster.csv'}, {out / 'links.csv'}, {out / 'cluster.md'}, {out / 'cluster.png'}")


def main(argv: list[str]) -> int:
    a = _parse(argv)
    netns.need_privileges()
    out, runs = Path(a.out), Path(a.runs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text(provenance(argv))
    rows: list[dict] = []
    links: list[dict] = []

    def save() -> None:
        write_csv(out / "cluster.csv", rows, FIELDS)
        write_csv(out / "links.csv", links, LINK_FIELDS)

    try:
        ceiling = _measure(a, out, runs, rows, links, save)
    except (BenchFailed, probe.ProbeFailed) as e:
        print(f"psgd bench cluster: failed: {e}", file=sys.stderr)
        return 1
    finally:
        save()
    _finish(rows, links, ceiling, a, out)
    return 0
