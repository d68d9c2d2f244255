"""`psgd bench utilisation`: compute utilisation against link rate on kernel-shaped links, beside the cost model.

Contract: the table of diloco-measured (2026; DDP, local SGD and DiLoCo at several H on tc-shaped
links) for psgd's methods: for each rate in `--rates` a cluster of its own (`psgd bench cluster`'s:
`shaped`, `cluster_name`, `calibration` and `machines`, from psgd/bench/shaped.py, and
the cluster is always taken down, also on a failure, Ctrl-C or SIGTERM), N = `--workers` workers
on it, and with `psgd run --hosts` (the shard on h0, worker r on h(r+1); all-reduce rank r on h r):
- sync PS, one shard (H = 1: one push and pull per step);
- all-reduce, gloo's (H = 1: one all-reduce of the gradients per step);
- local SGD: sync PS with `--local-steps H`, the outer step the replicas' plain average;
- DiLoCo: the same with `--outer nesterov` (the shard's outer SGD with Nesterov momentum);
each H of `--local-steps` run for `--rounds` rounds (H x rounds steps per worker). Every worker
sleeps `--compute-ms` per step before its forward pass (an emulated accelerator, as E10's), so that
the step has compute worth keeping busy. Per run, from its summary.json (`measured`):
    step_s        wall_time_s (start barrier to the last worker's end) / steps per worker: every
                  exchange of the run counted, the first pull and the last push (a push alone) too
    compute_s     seconds of compute per step and worker: forward + backward, the sleep, and with
                  H > 1 the worker's local optimizer step
    utilisation   compute_s / step_s: the fraction of the wall a worker computes
and beside it the cost model's (`predict`, psgd/core/costmodel.py, calibrated as `psgd bench cluster`
does: across each shaped link for the wire, on loopback for the shared CPU, the higher of the two
floors binding): a step is compute + (push + apply + pull) / H, the exchange of a sync step amortised
over the H local steps of a round (the all-reduce's H is 1), and its utilisation compute / step.
Writes OUT/utilisation.csv (every run, rewritten after each), OUT/utilisation.md (methods x H rows,
link-rate columns, measured beside model) and OUT/command.txt (the command, date, machine, code
commit). Needs root. Figures only; nothing asserts a speed.

    psgd bench utilisation                                      # about 6 minutes on 2 cores
    psgd bench utilisation --rates 1gbit --local-steps 8 --rounds 2   # a look
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from psgd.bench import record, scaling, shaped
from psgd.bench.transport import parse_int_list
from psgd.cluster import netns, probe
from psgd.core import costmodel as cm
from psgd.core import link as link_mod
from psgd.core.config import DataConfig, ModelConfig, RunConfig

METHODS = {"ps": "sync PS, 1 shard", "allreduce": "all-reduce (gloo)", "local": "local SGD (PS, outer average)",
           "diloco": "DiLoCo (PS, outer Nesterov)"}
FIELDS = ["rate", "method", "local_steps", "workers", "status", "steps", "step_s", "compute_s", "utilisation",
          "predicted_step_s", "predicted_compute_s", "predicted_utilisation", "bound", "predicted_wire_s",
          "predicted_cpu_s", "utilisation_over_model", "bytes_per_step", "wall_time_s", "params", "note"]


def plans(a: argparse.Namespace, name: str, runs: Path) -> list[tuple[str, int, RunConfig]]:
    """(method, H, config) of every run on cluster `name`: the wide MLP, tcp (the default across
    hosts), one shard, every rank sleeping --compute-ms per step; sync PS and gloo's all-reduce at
    H = 1 for --steps, local SGD and DiLoCo at each H of --local-steps for H x --rounds steps."""
    n = a.workers
    ps = RunConfig(mode="sync", workers=n, servers=1, steps=a.steps, batch_size=a.batch_size, eval_every=0,
                   device="cpu", rpc_timeout=600.0, hosts=n + 1, cluster=name,
                   straggler=tuple((r, a.compute_ms) for r in range(n)),
                   data=DataConfig(dataset="synthetic", num_samples=4000),
                   model=ModelConfig(model="wide_mlp", width=a.width), out=str(runs / "ps"))
    out = [("ps", 1, ps),
           ("allreduce", 1, dataclasses.replace(ps, mode="allreduce", allreduce_impl="library", hosts=n,
                                                out=str(runs / "allreduce")))]
    for method in ("local", "diloco"):
        optim = dataclasses.replace(ps.optim, outer="nesterov" if method == "diloco" else "sgd")
        out += [(method, h, dataclasses.replace(ps, local_steps=h, steps=h * a.rounds, optim=optim,
                                                out=str(runs / f"{method}-h{h}"))) for h in a.local_steps]
    return out


def measured(summary: dict) -> dict:
    """step_s, compute_s and utilisation of a finished run (see the module docstring)."""
    steps = statistics.mean(summary["per_worker_steps"].values())
    wall, compute = summary["wall_time_s"], summary["time_breakdown_s"]["compute"]
    return {"steps": steps, "step_s": wall / steps, "compute_s": compute / steps, "utilisation": compute / wall,
            "bytes_per_step": (summary["bytes_pushed"] + summary["bytes_pulled"]) / max(1, summary["worker_steps"]),
            "wall_time_s": wall, "params": summary["params"]}


def predict(method: str, n: int, h: int, ms: dict[str, cm.Machine], work: cm.Workload, compute_ms: float) -> dict:
    """The cost model's step and utilisation of (method, H) with n workers and one shard: its sync PS
    (or ring) step, its exchange (comm + apply) amortised over H local steps, in each of its two
    forms (the wire: `ms["ps"]` / `ms["ring"]`; the shared cores: `ms["cpu"]`), the slower binding.
    Compute is the model's plus the emulated --compute-ms, plus with H > 1 the worker's own optimizer
    step (the model's apply of the whole model), which it times as compute."""
    mode = "ring" if method == "allreduce" else "sync"
    forms = {}
    for bound, m in (("wire", ms["ring" if mode == "ring" else "ps"]), ("CPU", ms["cpu"])):
        st = cm.step_time(mode, n, 1, m, work)
        compute = st.compute_s + compute_ms / 1e3 + (work.size * m.apply_s_per_byte if h > 1 else 0.0)
        forms[bound] = (compute, compute + (st.total_s - st.compute_s) / h)
    bound = max(forms, key=lambda b: forms[b][1])
    compute, step = forms[bound]
    return {"predicted_step_s": step, "predicted_compute_s": compute, "predicted_utilisation": compute / step,
            "bound": bound, "predicted_wire_s": forms["wire"][1], "predicted_cpu_s": forms["CPU"][1]}


def rows_order(local_steps: list[int]) -> list[tuple[str, int]]:
    """The table's rows: sync PS and all-reduce at H = 1, then local SGD and DiLoCo at each H."""
    return [("ps", 1), ("allreduce", 1)] + [(m, h) for m in ("local", "diloco") for h in local_steps]


def find(rows: list[dict], rate: str, method: str, h: int) -> dict | None:
    for r in rows:
        if r["status"] == "ok" and (r["rate"], r["method"], int(r["local_steps"])) == (rate, method, h):
            return r
    return None


def table(rows: list[dict], rates: list[str], local_steps: list[int], cell, caption: str) -> list[str]:
    """A Markdown table: a row per (method, H), a column per rate, `cell(row)` in each ("—": no run)."""
    lines = [caption, "", "| method | H | " + " | ".join(rates) + " |", "|---|---|" + "---|" * len(rates)]
    for method, h in rows_order(local_steps):
        cells = [(cell(r) if (r := find(rows, rate, method, h)) else "—") for rate in rates]
        lines.append(f"| {METHODS[method]} | {h} | " + " | ".join(cells) + " |")
    return lines


def report(rows: list[dict], links: list[dict], a: argparse.Namespace, loads: tuple[float, float]) -> str:
    """utilisation.md: the utilisation table (measured, model), step times, the links, the caveats."""
    ok = [r for r in rows if r["status"] == "ok"]
    ratios = [r["utilisation"] / r["predicted_utilisation"] for r in ok]
    size = (f" ({ok[0]['params'] / 1e6:.1f}M parameters, {ok[0]['params'] * 4 / 1e6:.1f} MB per push)" if ok else "")
    caption = (f"Compute utilisation = compute time / wall time per step, measured (cost model): {a.workers} workers, "
               f"wide MLP width {a.width}{size}, batch {a.batch_size} per worker, {a.compute_ms} ms of emulated "
               f"compute per step on every worker, links RATE,{a.latency} shaped by the kernel (`psgd run --hosts` "
               "on a `psgd cluster`); H = local steps per exchange")
    lines = table(rows, a.rates, a.local_steps,
                  lambda r: f"{r['utilisation']:.1%} ({r['predicted_utilisation']:.1%})", caption)
    lines += [""] + table(rows, a.rates, a.local_steps,
                          lambda r: f"{r['step_s'] * 1e3:.1f} ({r['predicted_step_s'] * 1e3:.1f}, {r['bound']})",
                          "Milliseconds per step, measured (cost model, the floor that binds: the wire or the "
                          "shared CPU)")
    if ratios:
        lines += ["", f"Measured / model utilisation: {min(ratios):.2f} to {max(ratios):.2f} over {len(ratios)} "
                      f"points (median {statistics.median(ratios):.2f})."]
    lines += ["", "Links: one raw TCP stream h1 -> h0, and psgd's push / pull across it (1 / beta of the "
                  "calibration)", "", "| setting | raw TCP, Mbit/s | psgd push/pull, Mbit/s |", "|---|---|---|"]
    lines += [f"| {x['rate']} | {x['goodput_bits'] / 1e6:.0f} | {x['psgd_bits'] / 1e6:.0f} |" for x in links]
    lines += ["", f"Noisy: the machine's {len(os.sched_getaffinity(0))} CPU cores were shared with other jobs during "
                  f"the run (load average {loads[0]:.1f} at its start, {loads[1]:.1f} at its end), and every host "
                  "of the cluster computes on them; the emulated compute is a sleep, the rest of a step's compute "
                  "is real. One run per cell, "
                  f"{a.rounds} rounds per H (sync PS and all-reduce: {a.steps} steps)."]
    return "\n".join(lines) + "\n"


def run_rate(a: argparse.Namespace, rate: str, host: dict, out: Path, runs: Path, rows: list[dict],
             links: list[dict], save) -> None:
    lk = f"{rate},{a.latency}"
    with shaped.shaped(shaped.cluster_name(a.name, rate), a.workers + 1, lk) as c:
        bits = link_mod.parse(rate).bits_per_s
        got, seconds = probe.goodput(c, "h1", "h0", max(16 << 20, int(bits / 8 * a.probe_s)) & ~((1 << 20) - 1))
        cal = shaped.calibration(out / f"calibration-{rate}.json", a, c)
        links.append({"rate": rate, "goodput_bits": got * 8 / seconds,
                      "psgd_bits": 8 / cal["machine"]["beta_s_per_byte"]})
        ms = shaped.machines(cal, host, link_mod.parse(lk).latency_s, got * 8 / seconds)
        work = dataclasses.replace(cm.workload_from_dict(cal["workload"]), batch=a.batch_size)
        for method, h, cfg in plans(a, c.name, runs / rate):
            row = {"rate": rate, "method": method, "local_steps": h, "workers": a.workers,
                   **scaling.run_one(cfg, a.retries)}
            if row["status"] == "ok":
                row.update(measured(json.loads((Path(cfg.out) / "summary.json").read_text())))
                row.update(predict(method, a.workers, h, ms, dataclasses.replace(work, params=row["params"]),
                                   a.compute_ms))
                row["utilisation_over_model"] = row["utilisation"] / row["predicted_utilisation"]
            rows.append(row)
            print(f"{rate} {METHODS[method]} H={h}: " + (
                f"{row['step_s'] * 1e3:.1f} ms/step, utilisation {row['utilisation']:.1%} (model "
                f"{row['predicted_utilisation']:.1%})" if row["status"] == "ok" else row["status"]), flush=True)
            save()


def main(argv: list[str]) -> int:
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd bench utilisation", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1gbit,2gbit,10gbit", help="link rates, one cluster each")
    p.add_argument("--latency", default="200us", help="one-way latency of every link (psgd's pacer adds it)")
    p.add_argument("--workers", type=int, default=2, help="workers N (the cluster has N+1 hosts)")
    p.add_argument("--local-steps", default="8,32,128", help="local SGD's and DiLoCo's H values")
    p.add_argument("--rounds", type=int, default=2, help="rounds (exchanges) per local SGD / DiLoCo run")
    p.add_argument("--steps", type=int, default=10, help="steps per sync PS and all-reduce run")
    p.add_argument("--compute-ms", type=int, default=20, help="emulated compute per step on every worker (ms)")
    p.add_argument("--width", type=int, default=1024, help="wide_mlp width (1024: about 2.1M parameters)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per worker per step")
    shaped.add_cluster_flags(p, name="ut", repeat=3)
    p.add_argument("--out", default=record.scratch("bench/utilisation"), help="folder for the CSV, table and "
                   "command (default: %(default)s, git-ignored)")
    p.add_argument("--runs", default="results/runs/bench-utilisation", help="folder for the runs themselves")
    a = p.parse_args(argv)
    a.local_steps = parse_int_list(a.local_steps, "--local-steps")
    a.rates = [r.strip().lower() for r in a.rates.split(",") if r.strip()]
    try:
        shaped.check_rates(a.rates, a.latency, a.name)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if (not a.rates or a.workers < 2 or min(a.local_steps) < 2 or a.rounds < 2 or a.steps < 3 or a.compute_ms < 0
            or a.width < 1 or a.batch_size < 1 or a.retries < 0):
        raise UsageError("give --rates, --workers >= 2, --local-steps H >= 2, --rounds >= 2, --steps >= 3, "
                         "--compute-ms >= 0, --width and --batch-size >= 1, --retries >= 0")
    netns.need_privileges()
    out, runs = Path(a.out), Path(a.runs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text(record.provenance(argv, "utilisation"))
    start_load = os.getloadavg()[0]
    rows: list[dict] = []
    links: list[dict] = []

    def save() -> None:
        record.write_csv(out / "utilisation.csv", rows, FIELDS)

    try:
        host = shaped.host_calibration(out, a)
        for rate in a.rates:
            run_rate(a, rate, host, out, runs, rows, links, save)
    except (shaped.BenchFailed, probe.ProbeFailed) as e:
        print(f"psgd bench utilisation: failed: {e}", file=sys.stderr)
        return 1
    finally:
        save()
    (out / "utilisation.md").write_text(report(rows, links, a, (start_load, os.getloadavg()[0])))
    with open(out / "command.txt", "a") as f:
        f.write(f"# finished {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (load average "
                f"{os.getloadavg()[0]:.1f})\n")
    print((out / "utilisation.md").read_text())
    print(f"wrote {out / 'utilisation.csv'}, {out / 'utilisation.md'}, {out / 'command.txt'}")
    return 0
