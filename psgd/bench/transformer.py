"""`psgd bench transformer`: psgd on the transformer beside plain torch, side by side in one run.

Contract: one workload, the small GPT of `--model gpt --dataset text` (psgd/train/gpt.py; width,
layers and heads as flags, psgd's defaults unless given), batch `--batch-size` per worker, AdamW
(lr `--lr`, torch.optim.AdamW's other defaults), on the CPU. Four arms, each a fresh process (or
group of processes) started the same way, run `--rounds` times, interleaved (`order`: the two
arms of a ratio back to back, so that both see the same load on a machine shared with other work,
and no arm always first):
- `plain`: one process, no server: the same model (seeded build), the same batches (worker 0 of
  one), torch.optim.AdamW over `model.parameters()`: the loop a user writes without psgd.
- `ps`: `psgd run --mode async --workers 1 --servers 1 --transport tcp`: the same loop through
  one parameter shard (the shard steps AdamW; the worker pushes gradients, pulls parameters).
- `allreduce`: `psgd run --mode allreduce --workers 2 --backend gloo`.
- `ddp`: torch's DistributedDataParallel, 2 processes, gloo, the same model and batches (worker
  r of 2), torch.optim.AdamW; rendezvous through a file (no TCP store), GLOO_SOCKET_IFNAME=lo
  (supervise.child_env), so every socket is on 127.0.0.1.
Every arm's processes take psgd's own thread budget (psgd/train/threads.py `thread_budget`): the
plain loop the cores a lone psgd worker gets, each DDP rank what an all-reduce rank gets; or
`--threads` each, in every arm.

Metric: samples/s in the steady state, the same clock for every arm: the wall-clock time at the
end of each step (psgd: metrics.jsonl's step events; the torch arms record theirs the same way);
the first `--skip` steps and the last one are left out (warm-up; psgd's last push brings back no
parameters). `samples_per_s` = batch / the median step (time between consecutive step ends),
summed over the ranks: on cores shared with other work a step that waited for another process's
turn is an outlier the median ignores (a thread of a 2-thread op preempted stalls the whole op);
`samples_per_s_window` = kept steps / the window's wall time, every stall included.
Ratios, with their target: ps / plain (>= 0.8), allreduce / ddp (>= 0.9): the median over rounds
of each round's own ratio (its two runs back to back), their min and max, and beside it the ratio
of the two arms' medians and the same over the window.
Memory (`memory`): peak RSS of every process of each arm (VmHWM from /proc, read every 0.5 s, and
the launcher's own from wait4), summed over the processes, beside the 2 GiB budget; the sum of
their PSS at the busiest sample (shared pages counted once: the zygote's forks share torch).
And bytes per parameter held, counted from the tensors the objects hold after real steps
(`per_param`): the PS shard stepping AdamW, and a DiLoCo round (`--local-steps`, outer Nesterov)
through a served shard: the shard's outer momentum and the worker's inner AdamW and buffers.
Writes OUT/transformer.json (everything), OUT/transformer.csv (one row per run), OUT/TRANSFORMER.md
(the tables) and OUT/command.txt; the runs under `--runs` (their *.pt deleted).

    psgd bench transformer --out results/bench/transformer          # 4 rounds: 4-7 minutes on 2 shared cores
    psgd bench transformer --width 16 --layers 1 --heads 2 --steps 12 --rounds 1 --out /tmp/t
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# One run of one arm and what is measured of it live in psgd/bench/arms.py; every name of it that
# was defined here is imported back, so `from psgd.bench.transformer import ...` (roundtrip.py,
# the tests, tools/, the children's RUNNER) finds each where it always has.
from psgd.bench import record
from psgd.bench.arms import (  # noqa: F401 - re-exported: transformer.py's names, as before
    FLOOR_WAIT,
    RUNNER,
    TAG,
    MemoryPoll,
    child,
    held,
    launched_here,
    make_optimizer,
    per_param,
    psgd_rank_ends,
    rate_of,
    run_arm,
    run_processes,
    steady_rate,
    tagged,
    torch_loop,
)
from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig

ARMS = ("plain", "ps", "allreduce", "ddp")
LABELS = {"plain": "plain torch loop, no server (1 process)", "ps": "psgd async N=1 through 1 shard (tcp)",
          "allreduce": "psgd allreduce N=2 (gloo)", "ddp": "torch DistributedDataParallel N=2 (gloo)"}
RATIOS = (("ps_over_plain", "ps", "plain", 0.8), ("allreduce_over_ddp", "allreduce", "ddp", 0.9))
FIELDS = ["round", "arm", "status", "processes", "threads", "samples_per_s", "samples_per_s_window", "steps_timed",
          "step_ms", "compute_ms", "exchange_ms", "final_train_loss", "peak_rss_sum_mib", "peak_rss_max_mib",
          "peak_pss_sum_mib", "run_s", "note"]
BUDGET_MIB = 2048
MIB = 1 << 20


# -- the workload ---------------------------------------------------------------------------------
def workload(width: int = 0, layers: int = 2, heads: int = 4, batch: int = 32, steps: int = 100,
             lr: float = 3e-3, threads: int = 0) -> RunConfig:
    """The base config every arm derives from (`arm_config`)."""
    return RunConfig(steps=steps, batch_size=batch, threads=threads, eval_every=0, device="cpu", rpc_timeout=600.0,
                     transport="tcp",
                     data=DataConfig(dataset="text"), model=ModelConfig(model="gpt", width=width, layers=layers,
                                                                        heads=heads),
                     optim=OptimConfig(optimizer="adamw", lr=lr))


def arm_config(base: RunConfig, arm: str, out: Path) -> RunConfig:
    """The run of `arm`: the torch arms use the psgd run they stand beside (batches, threads);
    "default" is psgd run's own mode, workers and shards (sync, N=2, K=1), for its memory only."""
    if arm == "default":
        d = RunConfig()
        return dataclasses.replace(base, mode=d.mode, workers=d.workers, servers=d.servers, out=str(out))
    # shm: the ps arm, its payloads in shared memory (--transport shm)
    if arm in ("plain", "plain-sparse", *FLOOR_WAIT, "ps", "shm"):
        return dataclasses.replace(base, mode="async", workers=1, servers=1, out=str(out),
                                   **({"transport": "shm"} if arm == "shm" else {}))
    return dataclasses.replace(base, mode="allreduce", workers=2, servers=1, backend="gloo", out=str(out))



# -- the rounds and the table -----------------------------------------------------------------------------
def order(arms: list[str], round_index: int) -> list[str]:
    """Round `round_index`'s order: the two arms of each ratio back to back (they see the same load
    on a shared machine), which one first alternating every other round, which pair first every round."""
    pairs = [[num, den] for _, num, den, _ in RATIOS]
    if (round_index // 2) % 2:
        pairs = [pair[::-1] for pair in pairs]
    if round_index % 2:
        pairs = pairs[::-1]
    return [arm for pair in pairs for arm in pair if arm in arms]


def _median(rows: list[dict], key: str) -> float | None:
    """The median of a field every row has (None when some row has none: the torch arms' exchange)."""
    values = [r.get(key) for r in rows]
    return statistics.median(values) if values and None not in values else None


def summarise(rows: list[dict]) -> dict:
    """Per arm the median samples/s over its ok runs (min, max beside); per ratio the ratio of the
    medians, each round's ratio, and whether the target is met; the memory peaks per arm."""
    arms = {}
    for arm in ARMS:
        ok = [r for r in rows if r["arm"] == arm and r["status"] == "ok"]
        if ok:
            v = [r["samples_per_s"] for r in ok]
            arms[arm] = {"label": LABELS[arm], "runs": len(ok), "samples_per_s": statistics.median(v),
                         "min": min(v), "max": max(v), "step_ms": statistics.median(r["step_ms"] for r in ok),
                         "peak_rss_sum_mib": max(r["peak_rss_sum_mib"] for r in ok),
                         "peak_pss_sum_mib": max(r["peak_pss_sum_mib"] for r in ok),
                         "processes": max(r["processes"] for r in ok), "threads": ok[0]["threads"],
                         "compute_ms": _median(ok, "compute_ms"), "exchange_ms": _median(ok, "exchange_ms"),
                         "samples_per_s_window": _median(ok, "samples_per_s_window")}
    ratios = []
    for name, num, den, target in RATIOS:
        if num not in arms or den not in arms:
            ratios.append({"name": name, "num": num, "den": den, "target": target, "ratio": None, "met": None})
            continue
        of_medians = arms[num]["samples_per_s"] / arms[den]["samples_per_s"]
        per_round, window = [], []
        for rnd in sorted({r["round"] for r in rows}):
            pair = {r["arm"]: r for r in rows if r["round"] == rnd and r["status"] == "ok"}
            if num in pair and den in pair:
                per_round.append(pair[num]["samples_per_s"] / pair[den]["samples_per_s"])
                if pair[num].get("samples_per_s_window") and pair[den].get("samples_per_s_window"):
                    window.append(pair[num]["samples_per_s_window"] / pair[den]["samples_per_s_window"])
        value = statistics.median(per_round) if per_round else of_medians
        ratios.append({"name": name, "num": num, "den": den, "target": target, "ratio": value,
                       "ratio_of_medians": of_medians, "per_round": per_round, "min": min(per_round, default=None),
                       "max": max(per_round, default=None), "met": value >= target,
                       "window_per_round": window, "window_ratio": statistics.median(window) if window else None})
    return {"arms": arms, "ratios": ratios}


def format_tables(result: dict) -> str:
    s, m = result["summary"], result.get("per_param")
    lines = [f"# psgd bench transformer\n\nCommand: `{result['command']}`\n",
             f"Model: GPT width {result['model']['width']}, {result['model']['layers']} layers, "
             f"{result['model']['heads']} heads, block {result['model']['block']}, {result['model']['params']:,} "
             f"parameters; batch {result['batch_size']} per worker, AdamW lr {result['lr']:g}; {result['steps']} "
             f"steps per run, the first {result['skip']} and the last untimed; {result['rounds']} rounds, "
             f"interleaved. {result['machine']}\n",
             "| arm | samples/s (median over runs) | min - max | over the window, stalls in | ms / median step "
             "| processes | threads each | peak RSS, sum (MiB) | peak PSS, sum (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for a in s["arms"].values():
        window = a.get("samples_per_s_window")
        lines.append(f"| {a['label']} | {a['samples_per_s']:.0f} | {a['min']:.0f} - {a['max']:.0f} | "
                     f"{'-' if window is None else format(window, '.0f')} | {a['step_ms']:.1f} | {a['processes']} | "
                     f"{a['threads']} | {a['peak_rss_sum_mib']:.0f} | "
                     f"{a['peak_pss_sum_mib']:.0f} |")
    split = [f"{a['label']}: compute {a['compute_ms']:.1f} ms, exchange {a['exchange_ms']:.1f} ms"
             for a in s["arms"].values() if a.get("exchange_ms") is not None]
    if split:
        lines += ["", "Per worker step, median (summary.json's time_breakdown_s; exchange = push + pull + wait): "
                  + "; ".join(split) + "."]
    lines += ["", "| ratio | median of the rounds' ratios | per round | of the medians | over the window, stalls in "
              "| target | met |", "|---|---|---|---|---|---|---|"]
    for r in s["ratios"]:
        if r["ratio"] is None:
            lines.append(f"| {r['num']} / {r['den']} | - | - | - | - | >= {r['target']} | not measured |")
            continue
        rounds = ", ".join(f"{x:.2f}" for x in r["per_round"])
        window = "-" if r.get("window_ratio") is None else f"{r['window_ratio']:.2f}x (" + ", ".join(
            f"{x:.2f}" for x in r["window_per_round"]) + ")"
        lines.append(f"| {r['num']} / {r['den']} | {r['ratio']:.2f}x | {rounds} | {r['ratio_of_medians']:.2f}x | "
                     f"{window} | >= {r['target']}x | "
                     f"{'yes' if r['met'] else 'no'} |")
    if m:
        a, d = m["adamw_shard"], m["diloco"]
        lines += ["", "Bytes per parameter held (counted from the tensors after real steps):", "",
                  f"- PS shard, AdamW: {a['shard_bytes_per_param']:.2f} (fp32 parameter "
                  f"{a['shard_param_bytes_per_param']:g} + optimizer {a['shard_optimizer_bytes_per_param']:.2f}: "
                  f"{', '.join(a['shard_optimizer_tensors'])})",
                  f"- PS shard, DiLoCo outer Nesterov (--local-steps {d['local_steps']}): "
                  f"{d['shard_bytes_per_param']:.2f} (parameter {d['shard_param_bytes_per_param']:g} + outer momentum "
                  f"{d['shard_optimizer_bytes_per_param']:.2f}: {', '.join(d['shard_optimizer_tensors'])})",
                  f"- DiLoCo worker: inner AdamW {d['inner_optimizer_bytes_per_param']:.2f} "
                  f"({', '.join(d['inner_optimizer_tensors'])}); everything the worker's exchange and flat buffers "
                  f"hold: {d['worker_bytes_per_param']:.2f} ({', '.join(d['worker_tensors'])})"]
    d = result.get("memory_run")
    if d and d["status"] == "ok":
        each = ", ".join(f"{p['peak_rss_mib']:.0f}" for p in d["peak_rss_by_process"])
        lines.append(f"\n`{d['command']}` (psgd run's own mode and sizes: {d['processes']} processes, peak RSS "
                     f"{each} MiB): {d['peak_rss_sum_mib']:.0f} MiB summed, {d['peak_pss_sum_mib']:.0f} MiB PSS "
                     f"at the busiest sample, against the {BUDGET_MIB} MiB budget: "
                     f"{'within' if d['peak_rss_sum_mib'] <= BUDGET_MIB else 'OVER'}.")
    lines.append(f"\nMemory budget: {BUDGET_MIB} MiB for a default-size run in all its processes; "
                 + "; ".join(f"{arm} {a['peak_rss_sum_mib']:.0f} MiB RSS summed ({a['peak_pss_sum_mib']:.0f} PSS)"
                             for arm, a in s["arms"].items()))
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _changed(cfg: RunConfig) -> list[str]:
    """The `psgd run` flags of cfg that differ from psgd run's defaults (the command as a user types it)."""
    from psgd.core.config import leaves

    default, words = RunConfig(), []
    for leaf in leaves(RunConfig):
        mine, theirs = (getattr(getattr(c, leaf.section) if leaf.section else c, leaf.name) for c in (cfg, default))
        if mine != theirs and leaf.name != "out":
            flag = "--" + leaf.name.replace("_", "-")
            words += [flag] if leaf.type is bool else [flag, str(mine)]
    return words


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def _machine() -> str:
    """The context a reader of the figures needs: cores, their load, the code measured."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or "?"
        from psgd.bench.record import BENCH_CODE  # noqa: PLC0415 - results/ written meanwhile is no code change

        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *BENCH_CODE],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "?", ""
    return (f"{os.cpu_count()} CPU cores shared with other work, load average {os.getloadavg()[0]:.2f}; "
            f"Python {sys.version.split()[0]}; commit {commit}{' with uncommitted changes' if dirty else ''}")


def write_outputs(result: dict, out: Path) -> str:
    """OUT/transformer.json, OUT/transformer.csv and OUT/TRANSFORMER.md of a result; returns the tables."""
    (out / "transformer.json").write_text(json.dumps(result, indent=1))
    write_csv(result["rows"], out / "transformer.csv")
    table = format_tables(result)
    (out / "TRANSFORMER.md").write_text(table)
    return table


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str], RunConfig]:
    """(the flags, the arms to run, the base config) of `argv`, every value checked; UsageError on a bad one."""
    from psgd.core.config import validate
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd bench transformer", description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=0, help="the GPT's width (0: psgd's default, 128)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads (a divisor of the width)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    p.add_argument("--steps", type=int, default=100, help="steps per run (per worker)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per process in every arm (0: psgd's own budget, psgd run --threads)")
    p.add_argument("--skip", type=int, default=10, help="steps left out at the start of each run (warm-up)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds, each running every arm (4: every order)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"a comma-separated subset of {', '.join(ARMS)}")
    p.add_argument("--no-memory", action="store_true", help="skip counting bytes per parameter")
    p.add_argument("--out", default=record.scratch("bench/transformer"), help="folder for the JSON, CSV, tables, "
                   "command (default: %(default)s, git-ignored)")
    p.add_argument("--runs", default="results/runs/bench-transformer", help="folder for the runs themselves")
    a = p.parse_args(argv)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if not arms or not set(arms) <= set(ARMS) or len(set(arms)) != len(arms):
        raise UsageError(f"--arms takes a comma-separated subset of {', '.join(ARMS)}; got {a.arms!r}")
    if a.rounds < 1 or a.skip < 0 or a.steps < a.skip + 3:
        raise UsageError(f"--rounds must be >= 1 and --steps >= --skip + 3 (>= 2 timed steps), got --rounds "
                         f"{a.rounds} --steps {a.steps} --skip {a.skip}")
    base = workload(a.width, a.layers, a.heads, a.batch_size, a.steps, a.lr, a.threads)
    try:
        validate(base)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return a, arms, base


def _rounds(a: argparse.Namespace, arms: list[str], base: RunConfig, out: Path, runs: Path) -> list[dict]:
    """Every round's runs of every arm in its `order`, each printed as it ends; OUT/transformer.csv after each."""
    rows: list[dict] = []
    for rnd in range(1, a.rounds + 1):
        for arm in order(arms, rnd - 1):
            cfg = arm_config(base, arm, runs / f"round{rnd}" / arm)
            row = {"round": rnd, "arm": arm}
            try:
                row.update(run_arm(arm, cfg, a.skip))
            except (RuntimeError, ValueError, OSError, KeyError) as e:
                row.update(status=f"failed: {e}", note=str(e))
            rows.append(row)
            shown = f"{row['samples_per_s']:.0f} samples/s" if row["status"] == "ok" else row["status"]
            print(f"round {rnd} {arm}: {shown}", flush=True)
            write_csv(rows, out / "transformer.csv")  # rewritten after every run: partial results survive
    return rows


def _memory_run(base: RunConfig, runs: Path, skip: int) -> dict:
    """One run of psgd run's own mode and sizes (`arm_config`'s "default"), for its memory; printed."""
    cfg = arm_config(base, "default", runs / "default")
    memory_run = {"command": "psgd run " + " ".join(_changed(cfg)), "status": "ok"}
    try:
        memory_run.update(run_arm("default", cfg, skip))
    except (RuntimeError, ValueError, OSError, KeyError) as e:
        memory_run.update(status=f"failed: {e}")
    print(f"memory run: {memory_run.get('peak_rss_sum_mib', 0):.0f} MiB peak RSS summed", flush=True)
    return memory_run


def _result(a: argparse.Namespace, arms: list[str], base: RunConfig, command: str, rows: list[dict],
            memory_run: dict | None) -> dict:
    """Everything OUT/transformer.json holds: the command, the model, the flags, the rows and their summary."""
    from psgd.train import data, models, text

    return {"command": command, "machine": f"{os.cpu_count()} CPU cores shared with other work; CPU only",
            "model": {"width": base.model.width or 128, "layers": a.layers, "heads": a.heads, "block": text.BLOCK,
                      "vocab": text.VOCAB, "params": models.count(base.model, *data.SHAPES["text"])},
            "batch_size": a.batch_size, "lr": a.lr, "steps": a.steps, "skip": a.skip, "rounds": a.rounds,
            "arms": arms, "rows": rows, "summary": summarise(rows), "memory_budget_mib": BUDGET_MIB,
            "memory_run": memory_run, "per_param": None if a.no_memory else per_param(base)}


def main(argv: list[str]) -> int:
    # Imported (torch with them) before the runs, not by `_result` after them: an import while an arm
    # runs would take the cores it is timed on.
    from psgd.train import data, models, text  # noqa: F401 - for the import's timing; `_result` uses them

    a, arms, base = _parse(argv)
    out, runs = Path(a.out), Path(a.runs)
    out.mkdir(parents=True, exist_ok=True)
    command = "psgd bench transformer " + " ".join(argv)
    started = time.time()
    (out / "command.txt").write_text(f"{command}\n# started {_when(started)}; {_machine()}\n")
    rows = _rounds(a, arms, base, out, runs)
    memory_run = None if a.no_memory else _memory_run(base, runs, a.skip)
    print(write_outputs(_result(a, arms, base, command, rows, memory_run), out))
    with open(out / "command.txt", "a") as f:
        f.write(f"# finished {_when(time.time())}, took {time.time() - started:.0f} s; load average "
                f"{os.getloadavg()[0]:.2f}\n")
    print(f"wrote {out / 'transformer.json'}, {out / 'transformer.csv'}, {out / 'TRANSFORMER.md'}, "
          f"{out / 'command.txt'}")
    return 0
