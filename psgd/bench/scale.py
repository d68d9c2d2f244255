"""`psgd bench scale`: 8, 16 and 32 worker processes against 2 shards, in sync, async and SSP.

Contract: for every mode in `--modes` and every N in `--workers` it runs `psgd run --mode M
--workers N --servers K --steps S` (real shard and worker processes on 127.0.0.1, forked from the
warm parent) with the default MLP, and reports per run, from its summary.json and metrics.jsonl:
    samples_per_s, updates_per_s    throughput over the training time (start-up apart)
    startup_s                       launch to the first step (a `--baseline` N=4 run: 6 processes)
    wait_p50_ms / wait_p99_ms       time a step's pull was held by the policy (the barrier, SSP's bound)
    staleness_mean / _p99 / _max    updates between a gradient's pull and its apply
    gap_p99 / gap_max               clock gap of served pulls (pulling worker's clock - the slowest's)
    shard_peak_mib / worker_peak_mib  the largest peak RSS (VmHWM) of a shard process and of a worker
    model_samples_per_s             the alpha-beta cost model's prediction for the same N, K and model
                                    (psgd/core/costmodel.py, one 2-core host, the machine from
                                    `--calibration`; compute per step is the run's own measured mean,
                                    so the prediction tests the communication and contention terms).
                                    SSP is predicted as async (its ceiling: the bound only adds waits).
Writes OUT/scale.csv, OUT/scale.md (the table), OUT/scale.png (throughput and peak memory against
N, beside the model) and OUT/command.txt. Start-up at the largest N is also stated as a ratio to
the baseline's, measured in the same invocation. On 2 cores, 32 workers share the CPUs: this
measures the software's scaling under contention, not a cluster's.

    psgd bench scale                                   # 9 runs + a baseline, a few minutes on 2 cores
    psgd bench scale --workers 8,16,32 --modes sync,async,ssp --steps 100
"""

from __future__ import annotations

import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psgd.bench as bench
from psgd.bench import record
from psgd.bench.transport import parse_int_list

FIELDS = ("mode", "workers", "shards", "processes", "samples_per_s", "updates_per_s", "startup_s", "training_s",
          "wait_p50_ms", "wait_p99_ms", "staleness_mean", "staleness_p99", "staleness_max", "gap_p99", "gap_max",
          "shard_peak_mib", "worker_peak_mib", "model_samples_per_s", "model_ratio")


def quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _titled(out: Path) -> dict[str, str]:
    """pid -> title of the live processes of the run in `out`: every process of a run names itself
    `psgd zygote|shard K/S|worker R/N OUT` (psgd/train/proctitle.py), which is how `ps` finds them."""
    found = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if title.startswith("psgd ") and str(out) in title:
                found[pid] = title.strip()
    return found


def _hwm_mib(pid: str) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def _sample(out: Path, peaks: dict[str, tuple[str, float]]) -> None:
    for pid, title in _titled(out).items():
        hwm = _hwm_mib(pid)
        if hwm is not None:
            peaks[pid] = (title, max(hwm, peaks.get(pid, ("", 0.0))[1]))


def run_watched(argv: list[str], out: Path, log: Path, timeout: float = 900) -> dict[str, tuple[str, float]]:
    """Run `psgd run` to its end, reading each of its processes' peak RSS (VmHWM, a high-water mark)
    every 0.2 s; returns pid -> (title, peak MiB). A process's growth after its last read is missed.
    With psgd.bench.ZYGOTE set, the run is launched in this process instead (`watched_here`)."""
    if bench.ZYGOTE is not None:
        return watched_here(argv[3:], out, bench.ZYGOTE)
    peaks: dict[str, tuple[str, float]] = {}
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=f, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            _sample(out, peaks)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(argv[3:9])}... timed out after {timeout:.0f} s")
            time.sleep(0.2)  # sampling memory, not synchronising with the run
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # psgd run stops every process it started on Ctrl-C
            proc.wait(60)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[3:9])}... exited {proc.returncode}; see {log}")
    return peaks


def watched_here(args: list[str], out: Path, zygote) -> dict[str, tuple[str, float]]:
    """`psgd ARGS` (`psgd run` and the run's flags, parsed into a RunConfig by the schema's flags)
    launched in this process, its children forked from `zygote` (psgd.bench.ZYGOTE), their peak RSS
    read by a thread meanwhile (each names itself `psgd shard|worker ... OUT`, as the forks of a run's
    own zygote do), every 0.05 s: forked from a warm parent, a short run's processes live a fraction
    of a second."""
    import argparse
    import threading

    from psgd.core import config as C
    from psgd.train import launch, roles

    assert args[0] == "run", args
    parser = argparse.ArgumentParser(prog="psgd run")
    C.add_flags(parser)
    cfg = roles.config_from_args(parser.parse_args([a for a in args[1:] if a != "--quiet"]))
    peaks: dict[str, tuple[str, float]] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):  # sampling memory, not synchronising with the run
            _sample(out, peaks)

    watcher = threading.Thread(target=watch, name="psgd-bench-scale-watch", daemon=True)
    watcher.start()
    try:
        launch.run(cfg, zygote=zygote)
    except launch.RunFailed as e:
        raise RuntimeError(f"{' '.join(args[:6])}... failed: {e}") from None
    finally:
        done.set()
        watcher.join()
    return peaks


def one_run(mode: str, n: int, k: int, steps: int, staleness: int, runs: Path) -> dict:
    out = runs / f"{mode}-{n}"
    argv = [sys.executable, "-m", "psgd", "run", "--mode", mode, "--workers", str(n), "--servers", str(k),
            "--steps", str(steps), "--staleness", str(staleness), "--eval-every", str(steps), "--quiet",
            "--out", str(out)]
    runs.mkdir(parents=True, exist_ok=True)
    peaks = run_watched(argv, out, runs / f"{mode}-{n}.log")
    summary = json.loads((out / "summary.json").read_text())
    steps_ev = [e for e in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip())
                if e.get("event") == "step"]
    hist = {int(s): c for s, c in summary["staleness"]["hist"].items()}
    stale = [s for s, c in hist.items() for _ in range(c)]
    gaps = [e.get("clock_gap", 0) for e in steps_ev]
    role = {kind: [mib for title, mib in peaks.values() if title.startswith(f"psgd {kind} ")]
            for kind in ("shard", "worker")}
    return {"mode": mode, "workers": n, "shards": k, "processes": len(role["shard"]) + len(role["worker"]),
            "samples_per_s": summary["samples_per_s"], "updates_per_s": summary["updates_per_s"],
            "startup_s": summary["startup_s"], "training_s": summary["wall_time_s"],
            "wait_p50_ms": 1e3 * quantile([e["wait_s"] for e in steps_ev], 0.5),
            "wait_p99_ms": 1e3 * quantile([e["wait_s"] for e in steps_ev], 0.99),
            "staleness_mean": summary["staleness"]["mean"], "staleness_p99": quantile(stale, 0.99),
            "staleness_max": max(stale, default=0), "gap_p99": quantile(gaps, 0.99), "gap_max": max(gaps, default=0),
            "shard_peak_mib": max(role["shard"], default=0.0), "worker_peak_mib": max(role["worker"], default=0.0),
            "params": summary["params"], "batch": summary["global_batch"] // n,
            "compute_s": statistics.fmean(e["compute_s"] for e in steps_ev) if steps_ev else 0.0}


def predict(row: dict, calibration: str) -> float:
    import dataclasses

    from psgd.bench.costmodel_cli import load_calibration
    from psgd.core import costmodel as cm

    machine, work, _ = load_calibration(calibration)
    machine = dataclasses.replace(machine, cores=2)
    # The measured compute is already under contention; the model's `share` would count it twice.
    work = dataclasses.replace(work, params=row["params"], batch=row["batch"], jitter_s=0.0,
                               compute_s_fixed=row["compute_s"] / max(1.0, row["workers"] / 2),
                               compute_s_per_sample=0.0)
    mode = "sync" if row["mode"] == "sync" else "async"
    return cm.step_time(mode, row["workers"], row["shards"], machine, work).samples_per_s


def table(rows: list[dict], baseline: dict | None) -> str:
    head = ("| mode | N | processes | samples/s | model | start-up s | wait p50 / p99 ms | staleness mean / p99 / max "
            "| clock gap p99 / max | shard / worker peak MiB |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['workers']} | {r['processes']} | {r['samples_per_s']:,.0f} | "
                     f"{r['model_samples_per_s']:,.0f} ({r['model_ratio']:.2f}x) | {r['startup_s']:.2f} | "
                     f"{r['wait_p50_ms']:.2f} / {r['wait_p99_ms']:.2f} | {r['staleness_mean']:.2f} / "
                     f"{r['staleness_p99']:.0f} / {r['staleness_max']:.0f} | {r['gap_p99']:.0f} / {r['gap_max']:.0f} | "
                     f"{r['shard_peak_mib']:.0f} / {r['worker_peak_mib']:.0f} |")
    if baseline:
        big = max(rows, key=lambda r: r["processes"])
        lines.append(f"\nStart-up: {big['startup_s']:.2f} s at {big['processes']} processes ({big['mode']}, "
                     f"N={big['workers']}) against {baseline['startup_s']:.2f} s at {baseline['processes']} "
                     f"(N={baseline['workers']}): {big['startup_s'] / baseline['startup_s']:.2f}x, same invocation.")
    lines.append("\n'model' is the cost model's samples/s (its ratio to the measured); SSP is predicted as async.")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from psgd.core import palette

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode]
        colour = palette.color(mode)
        ns = [r["workers"] for r in rs]
        a.plot(ns, [r["samples_per_s"] for r in rs], "o-", color=colour, label=f"{mode} measured")
        a.plot(ns, [r["model_samples_per_s"] for r in rs], "x--", color=colour, alpha=0.6, label=f"{mode} model")
        b.plot(ns, [r["shard_peak_mib"] for r in rs], "o-", color=colour, label=f"{mode} shard")
        b.plot(ns, [r["worker_peak_mib"] for r in rs], "s:", color=colour, label=f"{mode} worker")
    a.set(xlabel="workers N (2 shards)", ylabel="samples/s", title="throughput against N, beside the cost model")
    b.set(xlabel="workers N (2 shards)", ylabel="peak RSS, MiB", title="largest peak RSS per process kind")
    for ax in (a, b):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd bench scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="8,16,32", help="worker counts N")
    p.add_argument("--shards", type=int, default=2, help="shards K")
    p.add_argument("--modes", default="sync,async,ssp", help="modes, comma-separated")
    p.add_argument("--steps", type=int, default=60, help="steps per worker")
    p.add_argument("--staleness", type=int, default=2, help="SSP's bound s")
    p.add_argument("--baseline", type=int, default=4, help="N of the start-up baseline run (sync; 0: none)")
    p.add_argument("--calibration", default=record.calibration(), help="the cost model's machine (default: "
                   "psgd bench calibrate's newest in results/tmp/bench, else the committed one: %(default)s)")
    p.add_argument("--out", default=record.scratch("bench/scale"), help="folder for the table, CSV, figure and "
                   "command (default: %(default)s, git-ignored)")
    p.add_argument("--runs", default="results/runs/scale", help="folder for the runs themselves")
    a = p.parse_args(argv)
    workers = parse_int_list(a.workers, "--workers")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not set(modes) <= {"sync", "async", "ssp"} or not modes:
        raise UsageError(f"--modes takes sync, async, ssp; got {a.modes!r}")
    if a.steps < 2 or a.shards < 1:
        raise UsageError("--steps must be >= 2 and --shards >= 1")
    out, runs = Path(a.out), Path(a.runs).resolve()
    out.mkdir(parents=True, exist_ok=True)
    baseline = one_run("sync", a.baseline, a.shards, a.steps, a.staleness, runs) if a.baseline else None
    rows = []
    for mode in modes:
        for n in workers:
            r = one_run(mode, n, a.shards, a.steps, a.staleness, runs)
            r["model_samples_per_s"] = predict(r, a.calibration)
            r["model_ratio"] = r["model_samples_per_s"] / r["samples_per_s"] if r["samples_per_s"] else 0.0
            rows.append(r)
            print(f"{mode} N={n}: {r['samples_per_s']:,.0f} samples/s, start-up {r['startup_s']:.2f} s, "
                  f"shard peak {r['shard_peak_mib']:.0f} MiB", flush=True)
    with open(out / "scale.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows + ([dict(baseline, model_samples_per_s=0, model_ratio=0)] if baseline else []))
    text = table(rows, baseline)
    (out / "scale.md").write_text(text)
    plot(rows, out / "scale.png")
    (out / "command.txt").write_text("psgd bench scale " + " ".join(argv) + "\n")
    print(text)
    return 0
