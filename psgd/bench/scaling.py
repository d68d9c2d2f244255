"""`psgd bench scaling`: the bottleneck sweep. Is one server the bottleneck, what does sharding buy?

Contract: trains the wide MLP (`--width`, 3500 = about 25M parameters) with `psgd run` (real
server and worker processes on 127.0.0.1) for every N in `--workers` with every K in `--shards`
(sync PS), and with the ring all-reduce (`--mode allreduce --allreduce-impl ring`) when
`--include-ring` and this psgd has that mode (else those rows say why they were skipped).
Per configuration, from the run's metrics (the first step, a warm-up, left out; in PS modes also
the last, whose push brings back no parameters):
    step_s          seconds per step (mean over workers of the time between step ends)
    updates_per_s   global updates per second (1 / step_s in sync and all-reduce)
    compute / comm / wait_s   seconds per step split: forward+backward, push+pull (all-reduce:
                    the collective), time held by the consistency policy (the barrier)
    busiest_bytes   bytes per step in + out of the busiest process (a shard, or a worker)
Writes OUT/scaling.csv, OUT/scaling.png (three panels), OUT/command.txt, and the runs under
`--runs` (metrics, summaries and logs; their parameter snapshots only with `--keep-runs`).
With a calibration (`psgd bench calibrate`) of the same width it also compares the cost model's
step times (psgd/core/costmodel.py, one host) with the measured ones: OUT/validation.csv.
`--overlap` adds a PS row with `psgd run --overlap` for each (N, K); `--link` runs the PS rows
over an emulated link (psgd/core/link.py); `--transports grpc,tcp` runs every PS row on each
transport (psgd/ps/tcp_server.py), side by side in one sweep.

    psgd bench scaling                                     # default: a few minutes on 2 cores
    psgd bench scaling --width 3500 --workers 1,2,4,8 --shards 1,2,4 --steps 6 --include-ring
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
from pathlib import Path

from psgd.bench import record
from psgd.bench.transport import parse_int_list
from psgd.core import costmodel as cm
from psgd.core import link, palette
from psgd.core.config import DataConfig, ModelConfig, RunConfig, to_argv
from psgd.train.metrics import read_events

FIELDS = ["mode", "workers", "shards", "overlap", "transport", "width", "params", "batch", "steps", "status", "step_s",
          "updates_per_s", "samples_per_s", "compute_s", "comm_s", "wait_s", "busiest_bytes", "busiest", "note"]


def ring_available() -> bool:
    """True once `psgd run` has the all-reduce mode with the hand-written ring."""
    import importlib.util

    return (importlib.util.find_spec("psgd.allreduce.collective") is not None
            and "allreduce_impl" in {f.name for f in dataclasses.fields(RunConfig)})


def measure(cfg: RunConfig, summary: dict) -> dict:
    """Per-step figures of one finished run (see the module docstring)."""
    out = Path(cfg.out)
    steps: dict[int, list[dict]] = {}
    for e in read_events(out / "metrics.jsonl"):
        if e.get("event") == "step":
            steps.setdefault(e["rank"], []).append(e)
    per_worker, parts = [], {"compute_s": [], "comm_s": [], "wait_s": []}
    # PushPull (the default PS exchange, psgd/ps/exchange.py): a step's push brings back the next
    # step's parameters, so the last step, with none to bring, is a push alone: it is left out too.
    pushpull = cfg.mode != "allreduce" and not (cfg.separate_pull or cfg.overlap) and cfg.local_steps == 1
    for events in steps.values():
        events.sort(key=lambda e: e["clock"])
        later = events[1:-1] if pushpull and len(events) >= 4 else events[1:]  # step 0 warms up pools and caches
        if len(later) >= 2:
            per_worker.append((later[-1]["time"] - later[0]["time"]) / (len(later) - 1))
        for e in later:
            parts["compute_s"].append(e["compute_s"])
            parts["comm_s"].append(e["pull_s"] + e["push_s"])
            parts["wait_s"].append(e["wait_s"])
    step_s = statistics.mean(per_worker) if per_worker else summary["wall_time_s"] / max(1, summary["global_updates"])
    size = summary["params"] * 4
    if cfg.mode == "allreduce":
        per_rank = (summary["bytes_pushed"] + summary["bytes_pulled"]) / max(1, summary["worker_steps"])
        busiest, who = per_rank, "rank"
    else:
        shards = [json.loads((out / f"shard-{k}.json").read_text()) for k in range(cfg.servers)]
        shard_bytes = max((s["bytes_in"] + s["bytes_out"]) / max(1, s["version"]) for s in shards)
        busiest, who = (shard_bytes, "shard") if shard_bytes >= 2 * size else (2 * size, "worker")
    return {"step_s": step_s, "updates_per_s": 1.0 / step_s, "samples_per_s": cfg.global_batch / step_s,
            **{k: statistics.mean(v) if v else 0.0 for k, v in parts.items()},
            "busiest_bytes": busiest, "busiest": who}


def run_one(cfg: RunConfig, retries: int, keep: bool = False) -> dict:
    """Run one configuration; a failed run is retried (and the failure kept in `note`)."""
    from psgd.train import launch

    row = {"mode": "ring" if cfg.mode == "allreduce" else cfg.mode, "workers": cfg.workers,
           "shards": cfg.servers if cfg.mode != "allreduce" else 0, "overlap": cfg.overlap,
           "transport": cfg.transport if cfg.mode != "allreduce" else "torch.distributed",
           "width": cfg.model.width, "batch": cfg.batch_size, "steps": cfg.steps}
    failures = []
    for _ in range(retries + 1):
        try:
            summary = launch.run(cfg)
        except (launch.RunFailed, ValueError, OSError) as e:
            failures.append(str(e))
            continue
        note = f"ok after a failed attempt: {failures[-1]}" if failures else ""
        measured = measure(cfg, summary)
        if not keep:
            # A 25M-parameter run leaves ~300 MB of snapshots; the sweep keeps its metrics and logs.
            for pt in Path(cfg.out).glob("*.pt"):
                pt.unlink()
        return {**row, "params": summary["params"], "status": "ok", "note": note, **measured}
    return {**row, "status": f"failed: {failures[-1]}", "note": f"{len(failures)} attempts"}


def configs(a: argparse.Namespace, out: Path) -> list[RunConfig | dict]:
    link = getattr(a, "link", "")
    base = RunConfig(mode="sync", steps=a.steps, batch_size=a.batch_size, eval_every=0, device="cpu",
                     rpc_timeout=600.0, data=DataConfig(dataset="synthetic", num_samples=4000),
                     model=ModelConfig(model="wide_mlp", width=a.width))
    todo: list[RunConfig | dict] = []
    for n in a.workers:
        for k in a.shards:
            for transport in getattr(a, "transports", ["grpc"]):
                for overlap in (False, True) if a.overlap else (False,):
                    name = f"ps-n{n}-k{k}" + ("-overlap" if overlap else "") + ("" if transport == "grpc" else "-tcp")
                    todo.append(dataclasses.replace(base, workers=n, servers=k, overlap=overlap, link=link,
                                                    transport=transport, out=str(out / name)))
        if a.include_ring and n >= 2:
            if link:
                todo.append({"mode": "ring", "workers": n, "shards": 0, "width": a.width, "batch": a.batch_size,
                             "steps": a.steps, "status": "skipped: --link paces the PS client only"})
            elif ring_available():
                todo.append(dataclasses.replace(base, mode="allreduce", workers=n, allreduce_impl="ring",
                                                out=str(out / f"ring-n{n}")))
            else:
                todo.append({"mode": "ring", "workers": n, "shards": 0, "width": a.width, "batch": a.batch_size,
                             "steps": a.steps, "status": "skipped: this psgd has no `psgd run --mode allreduce` "
                                                         "with --allreduce-impl yet"})
    return todo


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    series = list(dict.fromkeys((r["mode"], r["shards"], r["overlap"], r.get("transport", "grpc")) for r in ok))

    def label(key) -> str:
        mode, k, overlap, transport = key
        return "ring all-reduce" if mode == "ring" else (
            f"PS sync, K={k}" + (", overlap" if overlap else "") + (", tcp" if transport == "tcp" else ""))


    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    variants = 0
    for key in series:
        pts = sorted((r["workers"], r["updates_per_s"], r["busiest_bytes"]) for r in ok
                     if (r["mode"], r["shards"], r["overlap"], r.get("transport", "grpc")) == key)
        ns = [p[0] for p in pts]
        # The ring in its mode colour, PS sync in sync's; further PS variants (K, overlap, tcp) by dash.
        mode = "ring" if key[0] == "ring" else "sync"
        dash = "-" if mode == "ring" else palette.LINESTYLES[variants % len(palette.LINESTYLES)]
        variants += mode != "ring"
        style = dict(color=palette.color(mode), marker=palette.marker(mode), linestyle=dash, label=label(key))
        axes[0].plot(ns, [p[1] for p in pts], **style)
        axes[2].plot(ns, [p[2] / 1e6 for p in pts], **style)
    names, bottoms = [], []
    for i, r in enumerate(ok):
        names.append(f"{'ring' if r['mode'] == 'ring' else 'K=' + str(r['shards'])}{'+ov' if r['overlap'] else ''}"
                     f"{'/tcp' if r.get('transport') == 'tcp' else ''}\nN={r['workers']}")
        bottom = 0.0
        for part, color in (("compute_s", palette.VARIANT_COLORS[0]), ("comm_s", palette.VARIANT_COLORS[1]),
                            ("wait_s", palette.VARIANT_COLORS[3])):
            axes[1].bar(i, r[part], bottom=bottom, color=color, label=part[:-2] if i == 0 else None)
            bottom += r[part]
        bottoms.append(bottom)
    axes[1].set_xticks(range(len(names)), names, fontsize=6)
    for ax, ylabel, t in ((axes[0], "updates / s", "throughput"),
                          (axes[1], "seconds per step (mean per worker)", "where a step's time goes"),
                          (axes[2], "MB per step, in + out", "bytes through the busiest process")):
        ax.set_ylabel(ylabel)
        ax.set_title(t)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in (axes[0], axes[2]):
        ax.set_xlabel("workers N")
        ax.set_xscale("log", base=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def validate_against_model(rows: list[dict], calibration: Path, width: int) -> list[dict] | str:
    from psgd.bench.costmodel_cli import load_calibration

    machine, work, raw = load_calibration(str(calibration))
    if not raw:
        return f"no calibration at {calibration}: run `psgd bench calibrate --width {width}` to validate the model"
    if raw.get("model", {}).get("width") != width:
        return f"calibration is for width {raw.get('model', {}).get('width')}, not {width}: recalibrate"
    # The model's PS figures are fitted on one transport: validate the rows that used it.
    fitted = raw.get("transport", "grpc")
    measured = [r for r in rows if r["status"] == "ok" and r["mode"] in ("sync", "ring") and not r["overlap"]
                and r.get("transport") in (fitted, "torch.distributed")]
    return cm.validate(measured, machine, dataclasses.replace(work, params=int(measured[0]["params"]))) \
        if measured else "no measured rows"


def _parse(argv: list[str]) -> argparse.Namespace:
    """The flags of `argv`, the lists split and every value checked; UsageError on a bad one."""
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd bench scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=3500, help="wide_mlp hidden width (3500: about 25M parameters)")
    p.add_argument("--workers", default="1,2,4,8", help="worker counts N")
    p.add_argument("--shards", default="1,2,4", help="PS shard counts K")
    p.add_argument("--steps", type=int, default=6, help="updates per run (the first is a warm-up, not measured)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    p.add_argument("--include-ring", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the ring all-reduce for each N >= 2")
    p.add_argument("--overlap", action="store_true", help="add a PS --overlap row for each (N, K)")
    p.add_argument("--link", default="", help="run the PS rows over an emulated link, e.g. 1gbit,200us (core/link.py)")
    p.add_argument("--transports", default="grpc", help="PS transports, comma-separated: grpc, tcp (ps/transport.py)")
    p.add_argument("--keep-runs", action="store_true", help="keep each run's parameter snapshots (*.pt)")
    p.add_argument("--retries", type=int, default=1, help="rerun a failed configuration this many times")
    p.add_argument("--calibration", default=record.calibration(), help="cost model fit to validate (default: "
                   "psgd bench calibrate's newest in results/tmp/bench, else the committed one: %(default)s)")
    p.add_argument("--out", default=record.scratch("bench/scaling"), help="folder for the CSV, plot and command "
                   "(default: %(default)s, git-ignored)")
    p.add_argument("--runs", default="results/runs/scaling", help="folder for the runs themselves")
    a = p.parse_args(argv)
    a.workers, a.shards = parse_int_list(a.workers, "--workers"), parse_int_list(a.shards, "--shards")
    if a.width < 1 or a.steps < 3 or a.batch_size < 1 or a.retries < 0:
        raise UsageError("--width and --batch-size must be >= 1, --steps >= 3 (one warm-up, two to time), "
                         "--retries >= 0")
    try:
        link.parse(a.link)
    except ValueError as e:
        raise UsageError(str(e)) from None
    a.transports = [t.strip() for t in a.transports.split(",") if t.strip()]
    if not a.transports or not set(a.transports) <= {"grpc", "tcp"}:
        raise UsageError("--transports takes grpc and / or tcp, comma-separated")
    return a


def _sweep(a: argparse.Namespace, out: Path) -> list[dict]:
    """Every configuration's run (`configs`) under --runs, each printed as it ends; OUT/scaling.csv after each."""
    rows = []
    runs = Path(a.runs)
    runs.mkdir(parents=True, exist_ok=True)
    for item in configs(a, runs):
        if isinstance(item, dict):
            rows.append(item)
            print(f"{item['mode']} N={item['workers']}: {item['status']}", flush=True)
            continue
        row = run_one(item, a.retries, a.keep_runs)
        rows.append(row)
        shown = f"{row['step_s']:.3f} s/step" if row["status"] == "ok" else row["status"]
        print(f"{row['mode']} N={row['workers']} K={row['shards']}{' overlap' if row['overlap'] else ''}"
              f"{' tcp' if row['transport'] == 'tcp' else ''}: {shown}"
              f"   ({'psgd run ' + ' '.join(to_argv(item))})", flush=True)
        with open(out / "scaling.csv", "w", newline="") as f:  # rewritten after every run: partial results survive
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    return rows


def _check_model(rows: list[dict], a: argparse.Namespace, out: Path) -> None:
    """The cost model beside the measured rows (OUT/validation.csv, the table printed), or why not."""
    from psgd.bench.costmodel_cli import validation_table, write_csv

    checked = (validate_against_model(rows, Path(a.calibration), a.width) if not a.link
               else "not validated: the one-host model has no emulated link")
    if isinstance(checked, str):
        print(f"cost model: {checked}")
    else:
        write_csv(checked, out / "validation.csv")
        print("cost model vs measured (one host):\n" + validation_table(checked))


def main(argv: list[str]) -> int:
    a = _parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text("psgd bench scaling " + " ".join(argv) + "\n")
    rows = _sweep(a, out)
    if any(r["status"] == "ok" for r in rows):
        plot(rows, out / "scaling.png", f"wide MLP width {a.width}, batch {a.batch_size}/worker, sync PS vs ring, "
                                        "one host (2 cores shared by every process)")
    _check_model(rows, a, out)
    print(f"wrote {out / 'scaling.csv'}, {out / 'scaling.png'}")
    return 0
