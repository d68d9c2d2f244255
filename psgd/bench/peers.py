"""`psgd bench peers`: the same workload through psgd and through other parameter servers, interleaved.

Contract: one workload, the MLP 40 -> W -> W -> 10 on MNIST-1D (`--model mlp --width W --dataset
mnist1d`), batch 32 per worker, plain SGD lr 0.05 (no momentum), one parameter shard / server,
for every W in `--widths` and every configuration in `--configs` (async1: async N=1, sync2: sync
N=2, async2: async N=2), run by
- psgd: `psgd run` (launch.run, real processes) on each of `--transports` (grpc, tcp),
- PyTorch RPC: psgd/bench/rpc_peer.py, the RPC parameter-server tutorials' pattern, on
  TensorPipe bound to loopback with a file rendezvous (`--tensorpipe`: uv, its fastest setting
  here; rpc_peer.py says what each setting moves how),
- Ray: psgd/bench/ray_peer.py, Ray's parameter-server example, only when `import ray` works and
  a private network namespace can be made for it (ray_peer.py says why); otherwise every Ray cell
  says "skipped" and the output says why.
Every system gets the same RunConfig (the peers read psgd's config.json): same seeded init, same
batch plan, same budget (`--steps` updates in sync, steps x N gradients in async).
Metric: updates applied by the server per second of training, steady state (summary.json's
`updates_per_s` for psgd; the peers time it the same way: warm-up step and start-up excluded, the
clock starts at a start barrier). `--rounds` rounds run one after the other, each over every
width, configuration and system (the systems in a rotated order per round, so no system always
runs first); the table reports the median over rounds, and psgd / best peer ratios.
Start-up (`startup_s`): seconds from the benchmark asking for the job (psgd: `launch.run`; a peer:
spawning its processes) to its first training step, the same clock for every system.
Cross-check: in sync mode every system computes the same thing, so the final parameters are
compared with the first psgd transport's of the same round (`param_diff`, max |w - w_ref|) and
the final training losses are printed side by side.
Writes OUT/peers.csv (one row per run), OUT/peers.png (grouped bars, a panel per width),
OUT/command.txt; the runs themselves under `--runs` (their *.pt only with --keep-runs).

    psgd bench peers                                            # default: 36 runs, 4-6 minutes on 2 cores
    psgd bench peers --widths 16 --configs sync2 --steps 5 --rounds 1 --out /tmp/peers
"""

from __future__ import annotations

import argparse
import csv
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from psgd.bench import ray_peer, record, rpc_peer
from psgd.core import palette
from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig, to_dict
from psgd.train import launch, supervise
from psgd.train.metrics import read_events

CONFIGS = {"async1": ("async", 1), "sync2": ("sync", 2), "async2": ("async", 2)}
LABELS = {"rpc": "PyTorch RPC", "ray": "Ray", "grpc": "psgd grpc", "tcp": "psgd tcp"}
PEERS = ("rpc", "ray")
FIELDS = ["round", "width", "params", "mode", "workers", "system", "status", "steps", "global_updates", "wall_s",
          "updates_per_s", "run_s", "startup_s", "final_train_loss", "param_diff", "compute_ms", "exchange_ms",
          "pull_ms", "push_ms", "wait_ms", "note"]
# A peer process is `python -c RUNNER --config ...`, so that its module is imported under its own
# name (RPC pickles functions by module and name; under `-m` it would be `__main__`).
RUNNER = "import sys; from psgd.bench.{} import main; sys.exit(main(sys.argv[1:]))"
PEER_FILES = ("config.json", "result.json", "final_params.pt", "rendezvous")


def workload(width: int, config: str, steps: int, out: Path, system: str = "grpc") -> RunConfig:
    """The run of `system` (the peers ignore the transport: they read the rest of the config)."""
    mode, n = CONFIGS[config]
    return RunConfig(mode=mode, workers=n, servers=1, steps=steps, batch_size=32, eval_every=0, device="cpu",
                     rpc_timeout=600.0, transport="tcp" if system == "tcp" else "grpc",
                     data=DataConfig(dataset="mnist1d"), model=ModelConfig(model="mlp", width=width),
                     optim=OptimConfig(lr=0.05, momentum=0.0), out=str(out))


def run_psgd(cfg: RunConfig) -> dict:
    """One `psgd run`; its summary as a row's measured fields."""
    s = launch.run(cfg)
    ends = [e for e in read_events(Path(cfg.out) / "metrics.jsonl") if e.get("event") == "worker_end"]
    per_worker = s["worker_steps"] / cfg.workers
    split = {k: v / per_worker * 1e3 for k, v in s["time_breakdown_s"].items()}
    return {"params": s["params"], "global_updates": s["global_updates"], "wall_s": s["wall_time_s"],
            "updates_per_s": s["updates_per_s"], "final_train_loss": s["final_train_loss"],
            "compute_ms": split["compute"], "exchange_ms": split["pull"] + split["push"] + split["wait"],
            "pull_ms": split["pull"], "push_ms": split["push"], "wait_ms": split["wait"],
            "train_start": min(e["train_start"] for e in ends)}


def run_peer(system: str, cfg: RunConfig, tensorpipe: str = "uv") -> dict:
    """One peer run in processes of its own (rpc: N + 1 ranks; ray: one driver that starts Ray)."""
    out = Path(cfg.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for name in PEER_FILES:
        (out / name).unlink(missing_ok=True)  # a rerun's rendezvous file must be fresh
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
    # Loopback only: TensorPipe's sockets (TP_SOCKET_IFNAME) and the gloo group init_rpc makes
    # (GLOO_SOCKET_IFNAME, set by child_env) bind to lo; the rendezvous is a file.
    env = dict(supervise.child_env(), TP_SOCKET_IFNAME="lo")
    argv = [sys.executable, "-c", RUNNER.format(f"{system}_peer"), "--config", str(out / "config.json")]
    children: list[supervise.Child] = []
    try:
        if system == "rpc":
            for r in range(cfg.workers + 1):
                children.append(supervise.Child(f"rpc rank {r}", argv + ["--rank", str(r), "--tensorpipe", tensorpipe],
                                                out / "logs" / f"rank-{r}.log", env))
        else:
            children.append(supervise.Child("ray driver", ray_peer.ISOLATE + argv, out / "logs" / "driver.log",
                                            dict(env, **ray_peer.ENV)))
        supervise.wait_workers(children, [])  # returns when all exited 0, raises RunFailed on the first failure
    except BaseException:
        supervise.stop(children, signal.SIGKILL)
        raise
    r = json.loads((out / "result.json").read_text())
    per_worker = r["worker_steps"] / cfg.workers
    split = {k: v / per_worker * 1e3 for k, v in r.get("time_breakdown_s", {}).items()}
    return {"params": r["params"], "global_updates": r["global_updates"], "wall_s": r["wall_time_s"],
            "updates_per_s": r["updates_per_s"], "final_train_loss": r["final_train_loss"],
            "compute_ms": split.get("compute"), "exchange_ms": split.get("exchange"), "train_start": r["train_start"]}


def run_one(system: str, cfg: RunConfig, retries: int, tensorpipe: str) -> dict:
    """A row for one run; a failed run is retried (the failure kept in `note`)."""
    failures: list[str] = []
    for _ in range(retries + 1):
        t0, asked = time.perf_counter(), time.time()
        try:
            measured = run_psgd(cfg) if system in ("grpc", "tcp") else run_peer(system, cfg, tensorpipe)
        except (launch.RunFailed, ValueError, OSError, KeyError) as e:
            failures.append(str(e))
            continue
        # The whole run as this process saw it: start-up, training, teardown and evaluation. (psgd's
        # own startup_s counts from its launcher's process start: here, this benchmark's.)
        return {"status": "ok", "note": f"ok after a failed attempt: {failures[-1]}" if failures else "",
                "run_s": time.perf_counter() - t0, "startup_s": measured.pop("train_start") - asked, **measured}
    return {"status": f"failed: {failures[-1]}", "note": f"{len(failures)} attempts"}


def compare_params(rows: list[dict], runs: dict[str, Path], keep: bool) -> None:
    """Sync rows of one (round, width, config): max |w - w_ref| against psgd's final parameters
    (grpc's, else tcp's; the reference row gets 0). Then the *.pt go, unless kept."""
    ok = [r for r in rows if r["status"] == "ok"]
    ref = next((r for system in ("grpc", "tcp") for r in ok if r["system"] == system), None)
    if ref is not None and ref["mode"] == "sync":
        w_ref = torch.load(runs[ref["system"]] / "final_params.pt", weights_only=True)
        for r in ok:
            w = torch.load(runs[r["system"]] / "final_params.pt", weights_only=True)
            r["param_diff"] = float((w - w_ref).abs().max()) if w.shape == w_ref.shape else float("inf")
    if not keep:
        for path in runs.values():
            for pt in path.glob("*.pt"):
                pt.unlink()


def rotated(systems: list[str], round_index: int) -> list[str]:
    k = round_index % len(systems)
    return systems[k:] + systems[:k]


def aggregate(rows: list[dict], systems: list[str]) -> list[dict]:
    """One table row per (width, config): per system the median updates/s over its ok rounds (or
    its status), the median final loss, the largest sync param_diff; psgd / best peer ratios."""
    table = []
    keys = list(dict.fromkeys((r["width"], r["mode"], r["workers"]) for r in rows))
    for width, mode, n in keys:
        group = [r for r in rows if (r["width"], r["mode"], r["workers"]) == (width, mode, n)]
        entry: dict = {"width": width, "mode": mode, "workers": n,
                       "params": next((r["params"] for r in group if r.get("params")), None)}
        for s in systems:
            ok = [r for r in group if r["system"] == s and r["status"] == "ok"]
            entry[s] = statistics.median(r["updates_per_s"] for r in ok) if ok else \
                next((r["status"] for r in group if r["system"] == s), "not run")
            entry[f"{s}_rounds"] = [r["updates_per_s"] for r in ok]
            entry[f"{s}_loss"] = statistics.median(r["final_train_loss"] for r in ok) if ok else None
            entry[f"{s}_startup"] = statistics.median(r["startup_s"] for r in ok) if ok else None
            diffs = [r["param_diff"] for r in ok if r.get("param_diff") is not None]
            entry[f"{s}_diff"] = max(diffs) if diffs else None
        peers = [entry[p] for p in PEERS if p in systems and isinstance(entry[p], float)]
        entry["best_peer"] = max(peers) if peers else None
        for s in systems:
            if s not in PEERS:
                entry[f"{s}_ratio"] = entry[s] / entry["best_peer"] if entry["best_peer"] and \
                    isinstance(entry[s], float) else None
        table.append(entry)
    return table


def _cell(value, fmt: str = ".1f") -> str:
    if isinstance(value, float):
        return format(value, fmt)
    return "skipped" if str(value).startswith("skipped") else ("failed" if str(value).startswith("failed") else "-")


def format_table(table: list[dict], systems: list[str]) -> str:
    psgd = [s for s in systems if s not in PEERS]
    head = ["W (params)", "mode", "N", *(LABELS[s] for s in systems), *(f"{s} / best peer" for s in psgd)]
    lines = ["updates per second applied by the server (median over rounds):",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in table:
        params = f"{e['params']:,}" if e["params"] else "?"
        lines.append("| " + " | ".join([f"{e['width']} ({params})", e["mode"], str(e["workers"]),
                                          *(_cell(e[s]) for s in systems),
                                          *(_cell(e[f"{s}_ratio"], ".2f") for s in psgd)]) + " |")
    head = ["W", "mode", "N", *(LABELS[s] for s in systems)]
    lines += ["", "start-up, s from asking for the job to its first step (median over rounds):",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in table:
        lines.append("| " + " | ".join([str(e["width"]), e["mode"], str(e["workers"]),
                                          *(_cell(e[f"{s}_startup"], ".2f") for s in systems)]) + " |")
    head = ["W", "mode", "N", *(LABELS[s] for s in systems), "max abs param diff (sync)"]
    lines += ["", "final training loss (sync: the same computation in every system, so the same loss):",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in table:
        diffs = [e[f"{s}_diff"] for s in systems if e[f"{s}_diff"] is not None]
        lines.append("| " + " | ".join([str(e["width"]), e["mode"], str(e["workers"]),
                                          *(_cell(e[f"{s}_loss"], ".6f") for s in systems),
                                          f"{max(diffs):.3g}" if diffs else "-"]) + " |")
    return "\n".join(lines)


def format_split(rows: list[dict]) -> str:
    """Where a worker step's time went, ms (median over rounds): compute vs everything else."""
    lines = ["ms per worker step (median over rounds): compute | exchange (psgd: pull + push + wait; "
             "RPC: the push_pull call, server and waiting included)"]
    keys = list(dict.fromkeys((r["width"], r["mode"], r["workers"], r["system"]) for r in rows
                              if r["status"] == "ok" and r.get("compute_ms") is not None))
    for key in keys:
        ok = [r for r in rows if (r["width"], r["mode"], r["workers"], r["system"]) == key and r["status"] == "ok"]

        def med(field: str, ok: list[dict] = ok) -> float:
            return statistics.median(r[field] for r in ok)

        detail = (f" (pull {med('pull_ms'):.2f}, push {med('push_ms'):.2f}, wait {med('wait_ms'):.2f})"
                  if ok[0].get("pull_ms") is not None else "")
        lines.append(f"  W={key[0]} {key[1]} N={key[2]} {LABELS[key[3]]:<12} compute {med('compute_ms'):7.2f}"
                     f" | exchange {med('exchange_ms'):7.2f}{detail}")
    return "\n".join(lines)


def plot(table: list[dict], systems: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = list(dict.fromkeys(e["width"] for e in table))
    drawn = [s for s in systems if any(isinstance(e[s], float) for e in table)]
    fig, axes = plt.subplots(1, len(widths), figsize=(5.5 * len(widths), 4.2), squeeze=False)
    bar = 0.8 / max(1, len(drawn))
    for ax, width in zip(axes[0], widths, strict=True):
        rows = [e for e in table if e["width"] == width]
        for j, s in enumerate(drawn):
            xs = [i + (j - (len(drawn) - 1) / 2) * bar for i in range(len(rows))]
            heights = [e[s] if isinstance(e[s], float) else 0.0 for e in rows]
            ax.bar(xs, heights, bar, color=palette.VARIANT_COLORS[(j + 1) % len(palette.VARIANT_COLORS)],
                   edgecolor="black", linewidth=0.5, label=LABELS[s])
            for x, e in zip(xs, rows, strict=True):  # every round as a dot: the spread behind the median
                rounds = e[f"{s}_rounds"]
                ax.plot([x] * len(rounds), rounds, linestyle="none", marker="o", markersize=3, color=palette.REF_COLOR)
        ax.set_xticks(range(len(rows)), [f"{e['mode']}\nN={e['workers']}" for e in rows])
        params = f"{rows[0]['params']:,} params" if rows[0]["params"] else ""
        ax.set_title(f"W = {width} ({params})", fontsize=9)
        ax.set_ylabel("updates / s (median; dots: rounds)")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _list(text: str, flag: str, allowed: tuple[str, ...]) -> list[str]:
    from psgd.core.errors import UsageError

    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not set(items) <= set(allowed) or len(set(items)) != len(items):
        raise UsageError(f"{flag} takes a comma-separated subset of {', '.join(allowed)}; got {text!r}")
    return items


def _parse(argv: list[str]) -> argparse.Namespace:
    """The flags of `argv`, the lists split and checked (--steps one per width); UsageError on a bad one."""
    from psgd.bench.transport import parse_int_list
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd bench peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="256,2048", help="hidden widths W of the MLP 40 -> W -> W -> 10")
    p.add_argument("--configs", default="async1,sync2,async2", help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--steps", default="300,40",
                   help="budget per run: updates in sync, per worker in async (one value, or one per width)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the table shows the median")
    p.add_argument("--transports", default="grpc,tcp", help="psgd transports: grpc, tcp")
    p.add_argument("--peers", default="rpc,ray", help="peers: rpc (PyTorch RPC), ray (when installed)")
    p.add_argument("--tensorpipe", default="uv", choices=rpc_peer.TENSORPIPE,
                   help="how the RPC peer's TensorPipe moves bytes: uv (loopback TCP, tensors copied process to "
                        "process), sockets (all over loopback TCP), auto (TensorPipe's choice: shared memory)")
    p.add_argument("--retries", type=int, default=1, help="rerun a failed run this many times")
    p.add_argument("--keep-runs", action="store_true", help="keep each run's parameter files (*.pt)")
    p.add_argument("--out", default=record.scratch("bench/peers"), help="folder for the CSV, figure and command "
                   "(default: %(default)s, git-ignored)")
    p.add_argument("--runs", default="results/runs/peers", help="folder for the runs themselves")
    a = p.parse_args(argv)
    a.widths = parse_int_list(a.widths, "--widths")
    a.steps = parse_int_list(a.steps, "--steps")
    if len(a.steps) == 1:
        a.steps *= len(a.widths)
    if len(a.steps) != len(a.widths) or min(a.steps) < 2 or a.rounds < 1 or a.retries < 0:
        raise UsageError("--steps takes one value >= 2 or one per width; --rounds must be >= 1, --retries >= 0")
    a.configs = _list(a.configs, "--configs", tuple(CONFIGS))
    a.peers = _list(a.peers, "--peers", PEERS)
    a.transports = _list(a.transports, "--transports", ("grpc", "tcp"))
    return a


def _group(a: argparse.Namespace, rnd: int, width: int, budget: int, config: str, systems: list[str], runs: Path,
           ray_skipped: str | None) -> list[dict]:
    """One round's runs of one width and config, every system in this round's order, parameters compared."""
    group, paths = [], {}
    for system in rotated(systems, rnd - 1):
        paths[system] = runs / f"round{rnd}" / f"{system}-w{width}-{config}"
        cfg = workload(width, config, budget, paths[system], system)
        row = {"round": rnd, "width": width, "mode": cfg.mode, "workers": cfg.workers,
               "system": system, "steps": budget}
        if system == "ray" and ray_skipped:
            row.update(status=f"skipped: {ray_skipped}")
        else:
            row.update(run_one(system, cfg, a.retries, a.tensorpipe))
            if system == "rpc":
                row["note"] = "; ".join(filter(None, [f"tensorpipe={a.tensorpipe}", row["note"]]))
        group.append(row)
        shown = f"{row['updates_per_s']:.1f} updates/s" if row["status"] == "ok" else row["status"]
        print(f"round {rnd} W={width} {config} {LABELS[system]}: {shown}", flush=True)
    compare_params(group, {s: paths[s] for s in systems if s in paths}, a.keep_runs)
    return group


def _report(rows: list[dict], systems: list[str], a: argparse.Namespace, out: Path, ray_skipped: str | None) -> None:
    """After every round: OUT/peers.png (when something was measured) and the tables printed."""
    table = aggregate(rows, systems)
    if any(isinstance(e[s], float) for e in table for s in systems):
        plot(table, systems, out / "peers.png",
             "MLP 40-W-W-10 on MNIST-1D, batch 32/worker, SGD lr 0.05, 1 server; one host "
             "(every process shares the cores)" + ("; Ray: skipped" if ray_skipped else ""))
    print(format_table(table, systems))
    if "rpc" in a.peers:
        print(f"PyTorch RPC on TensorPipe --tensorpipe {a.tensorpipe} (psgd/bench/rpc_peer.py says what moves how)")
    print(format_split(rows))
    if ray_skipped:
        print(f"ray: skipped: {ray_skipped}")
    print(f"wrote {out / 'peers.csv'}, {out / 'peers.png'}, {out / 'command.txt'}")


def main(argv: list[str]) -> int:
    a = _parse(argv)
    systems = a.peers + a.transports
    out, runs = Path(a.out), Path(a.runs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text("psgd bench peers " + " ".join(argv) + "\n")
    ray_skipped = ray_peer.skip_reason() if "ray" in a.peers else None
    if ray_skipped:
        print(f"ray: skipped: {ray_skipped}", flush=True)
    rows: list[dict] = []
    for rnd in range(1, a.rounds + 1):
        for width, budget in zip(a.widths, a.steps, strict=True):
            for config in a.configs:
                rows += _group(a, rnd, width, budget, config, systems, runs, ray_skipped)
                write_csv(rows, out / "peers.csv")  # rewritten after every group: partial results survive
    _report(rows, systems, a, out, ray_skipped)
    return 0
