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
  (launch.child_env), so every socket is on 127.0.0.1.
Every arm's processes take psgd's own thread budget (psgd/train/launch.py `thread_budget`): the
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

import csv
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psgd.bench as bench
from psgd.core.config import DataConfig, ModelConfig, OptimConfig, RunConfig, from_dict, to_argv, to_dict

ARMS = ("plain", "ps", "allreduce", "ddp")
LABELS = {"plain": "plain torch loop, no server (1 process)", "ps": "psgd async N=1 through 1 shard (tcp)",
          "allreduce": "psgd allreduce N=2 (gloo)", "ddp": "torch DistributedDataParallel N=2 (gloo)"}
RATIOS = (("ps_over_plain", "ps", "plain", 0.8), ("allreduce_over_ddp", "allreduce", "ddp", 0.9))
FIELDS = ["round", "arm", "status", "processes", "threads", "samples_per_s", "samples_per_s_window", "steps_timed",
          "step_ms", "compute_ms", "exchange_ms", "final_train_loss", "peak_rss_sum_mib", "peak_rss_max_mib",
          "peak_pss_sum_mib", "run_s", "note"]
BUDGET_MIB = 2048
FLOOR_WAIT = {"floor": "block", "floor-spin": "spin"}  # psgd bench roundtrip's floor arms (psgd/bench/floor.py)
RUNNER = "import sys; from psgd.bench.transformer import child; sys.exit(child(sys.argv[1:]))"
TAG = "PSGD_BENCH_TRANSFORMER"  # in every process of an arm (inherited): how the memory poll finds them
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
    if arm in ("plain", *FLOOR_WAIT, "ps", "shm"):  # shm: the ps arm, its payloads in shared memory (--transport shm)
        return dataclasses.replace(base, mode="async", workers=1, servers=1, out=str(out),
                                   **({"transport": "shm"} if arm == "shm" else {}))
    return dataclasses.replace(base, mode="allreduce", workers=2, servers=1, backend="gloo", out=str(out))


def steady_rate(ends: list[float], skip: int) -> tuple[float, float, int]:
    """(steps/s at the median step, steps/s over the window, steps timed) from one rank's
    step-end times (see the module docstring)."""
    kept = ends[skip:-1]
    if len(kept) < 3 or kept[-1] <= kept[0]:
        raise ValueError(f"{len(ends)} steps leave {len(kept)} to time after skipping {skip} and the last: "
                         "give more --steps or fewer --skip")
    steps = [b - a for a, b in zip(kept, kept[1:], strict=False)]
    return 1.0 / statistics.median(steps), len(steps) / (kept[-1] - kept[0]), len(steps)


def rate_of(ends_by_rank: list[list[float]], skip: int, batch: int) -> dict:
    """samples/s summed over the ranks (at the median step, and over the window), ms per median step."""
    rates = [steady_rate(ends, skip) for ends in ends_by_rank]
    return {"samples_per_s": sum(r[0] for r in rates) * batch, "samples_per_s_window": sum(r[1] for r in rates) * batch,
            "steps_timed": min(r[2] for r in rates), "step_ms": 1e3 / statistics.mean(r[0] for r in rates)}


# -- the torch arms, in their own processes ---------------------------------------------------------
def torch_loop(cfg: RunConfig, rank: int, ddp_store: str = "") -> dict:
    """The plain loop (no `ddp_store`) or one DDP rank: psgd's batches and model, torch's AdamW (or SGD)."""
    import torch
    from torch import distributed as dist

    from psgd.train import assemble, launch

    torch.set_num_threads(launch.thread_budget(cfg))
    parts = assemble.worker_parts(cfg, rank, torch.device("cpu"))
    model, loss_fn = parts.model, parts.loss
    # psgd's worker warms up the same way before its clock starts (psgd/train/worker.py warm_up).
    xb, yb = parts.batches.micro(0)[0]
    loss_fn(model(xb), yb).backward()
    model.zero_grad(set_to_none=True)
    net = model
    if ddp_store:
        dist.init_process_group("gloo", init_method=f"file://{ddp_store}", rank=rank, world_size=cfg.workers)
        net = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters; 25 MiB buckets
    opt = make_optimizer(net.parameters(), cfg)
    if ddp_store:
        dist.barrier()  # the clock starts when every rank is ready, as psgd's start barrier
    ends, compute_s, loss = [], 0.0, 0.0
    for clock in range(cfg.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        for xm, ym in parts.batches.micro(clock):
            out = loss_fn(net(xm), ym)
            out.backward()  # DDP: the buckets' all-reduce runs here, overlapped with backward
            loss = float(out.detach())
        compute_s += time.perf_counter() - t0
        opt.step()
        ends.append(time.time())
    if ddp_store:
        dist.destroy_process_group()
    return {"rank": rank, "ends": ends, "final_train_loss": loss, "threads": torch.get_num_threads(),
            "compute_s": compute_s}


def make_optimizer(params, cfg: RunConfig):
    """torch's own optimizer of `cfg` over `params`: SGD (psgd bench roundtrip's MLP, what a shard's
    update computes) or AdamW."""
    import torch

    o = cfg.optim
    if o.optimizer == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def child(argv: list[str]) -> int:
    """`python -c RUNNER --config C --rank R [--ddp-store PATH | --floor WAIT]`: one torch arm's process."""
    import argparse

    p = argparse.ArgumentParser(prog="psgd.bench.transformer child")
    p.add_argument("--config", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--ddp-store", default="")
    p.add_argument("--floor", choices=("block", "spin"), help="a floor arm (psgd/bench/floor.py), its wait")
    a = p.parse_args(argv)
    cfg = from_dict(json.loads(Path(a.config).read_text()))
    if a.floor:
        from psgd.bench.floor import floor_loop

        result = floor_loop(cfg, make_optimizer, a.floor)
    else:
        result = torch_loop(cfg, a.rank, a.ddp_store)
    (Path(cfg.out) / f"result-{a.rank}.json").write_text(json.dumps(result))
    return 0


# -- memory: the processes of one arm -----------------------------------------------------------------
def _status_kib(pid: str, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _pss_kib(pid: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _command(pid: str) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    words = [Path(words[0]).name, *words[1:]] if words else []
    return " ".join(w for w in words if w)[:100]


def tagged(tag: str) -> list[str]:
    """Live processes whose environment holds TAG=tag (every descendant of a process started with it)."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.append(pid)
            except OSError:
                continue
    return found


class MemoryPoll:
    """Every `period` s: the peak RSS (VmHWM, a high-water mark) of each tagged process, and the
    sum of their PSS now; `stop()` returns the peaks. A process's growth after its last read is
    missed (at most `period` s of it); the launcher's own peak comes from wait4 instead."""

    def __init__(self, tag: str, period: float = 0.5) -> None:
        self.tag, self.period = tag, period
        self.peaks: dict[str, int] = {}
        self.names: dict[str, str] = {}  # pid -> what it runs (its command line, shortened)
        self.pss_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psgd-bench-memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            pss = 0
            for pid in tagged(self.tag):
                hwm = _status_kib(pid, "VmHWM")
                if hwm is not None:
                    self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)
                    if pid not in self.names:
                        self.names[pid] = _command(pid)
                    pss += _pss_kib(pid)
            self.pss_peak = max(self.pss_peak, pss)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def run_processes(argvs: list[list[str]], logs: list[Path], tag: str, timeout: float) -> dict:
    """Run the processes to their end under the memory poll; RunFailed-like RuntimeError on a failure."""
    from psgd.train import launch

    env = dict(launch.child_env(), **{TAG: tag})
    procs = []
    for argv, log in zip(argvs, logs, strict=True):
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(argv, stdout=f, stderr=f, stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True))
    poll = MemoryPoll(tag)
    poll.names.update({str(p.pid): " ".join([Path(p.args[0]).name, *p.args[1:]])[:100] for p in procs})
    own: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    failed = ""
    try:
        pending = list(procs)
        while pending:
            for p in list(pending):
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    p.returncode = os.waitstatus_to_exitcode(status)
                    own[str(p.pid)] = usage.ru_maxrss  # KiB on Linux: exact, unlike the poll
                    pending.remove(p)
                    if p.returncode != 0:
                        failed = failed or f"{' '.join(p.args[:6])}... exited {p.returncode}: " + _last_line(
                            logs[procs.index(p)])
            if failed or time.monotonic() > deadline:
                failed = failed or f"timed out after {timeout:.0f} s"
                break
            time.sleep(0.05)  # polling the children's exit, not synchronising with them
    finally:
        for p in procs:
            if p.returncode is None:
                with _quiet():
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        peaks = poll.stop()
    if failed:
        raise RuntimeError(failed)
    for pid, kib in own.items():
        peaks[pid] = max(peaks.get(pid, 0), kib)
    by_process = [{"pid": int(pid), "command": poll.names.get(pid, "?"),
                   "peak_rss_mib": kib / 1024} for pid, kib in sorted(peaks.items(), key=lambda kv: -kv[1])]
    return {"processes": len(peaks), "peak_rss_by_process": by_process, "peak_rss_sum_mib": sum(peaks.values()) / 1024,
            "peak_rss_max_mib": max(peaks.values(), default=0) / 1024, "peak_pss_sum_mib": poll.pss_peak / 1024}


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, *rest) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError)


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


# -- one run of one arm ---------------------------------------------------------------------------------
def launched_here(cfg: RunConfig, zygote) -> dict:
    """`psgd run` (cfg) launched in this process, its children forked from `zygote` (psgd.bench.ZYGOTE);
    RuntimeError if it failed, as `run_processes`. Its processes are not polled for memory (a fork's
    /proc environ is its parent's, without the tag): the memory fields say none was seen."""
    from psgd.train import launch

    try:
        launch.run(cfg, zygote=zygote)
    except launch.RunFailed as e:
        raise RuntimeError(f"psgd run ({cfg.out}) failed: {e}") from None
    return {"processes": 0, "peak_rss_by_process": [], "peak_rss_sum_mib": 0.0, "peak_rss_max_mib": 0.0,
            "peak_pss_sum_mib": 0.0}


def psgd_rank_ends(out: Path) -> list[list[float]]:
    """Each rank's step-end times from a psgd run's metrics.jsonl."""
    from psgd.train.metrics import read_events

    by_rank: dict[int, list[tuple[int, float]]] = {}
    for e in read_events(out / "metrics.jsonl"):
        if e.get("event") == "step":
            by_rank.setdefault(e["rank"], []).append((e["clock"], e["time"]))
    return [[t for _, t in sorted(v)] for _, v in sorted(by_rank.items())]


def run_arm(arm: str, cfg: RunConfig, skip: int, timeout: float = 600.0) -> dict:
    """One run of `arm` (config from `arm_config`): its measured fields."""
    out = Path(cfg.out)
    tag = f"{os.getpid()}-{out.parent.name}-{out.name}"
    t0 = time.perf_counter()
    if arm in ("ps", "shm", "allreduce", "default"):
        # psgd run makes (or reuses) its own folder; the launcher's output goes beside it.
        out.parent.mkdir(parents=True, exist_ok=True)
        if bench.ZYGOTE is not None:
            mem = launched_here(cfg, bench.ZYGOTE)
        else:
            argv = [sys.executable, "-m", "psgd", "run", *to_argv(cfg), "--quiet"]
            mem = run_processes([argv], [out.parent / f"{out.name}-launcher.log"], tag, timeout)
        s = json.loads((out / "summary.json").read_text())
        measured = rate_of(psgd_rank_ends(out), skip, cfg.batch_size)
        split = {k: v / (s["worker_steps"] / cfg.workers) * 1e3 for k, v in s["time_breakdown_s"].items()}
        from psgd.train import launch

        extra = {"threads": launch.thread_budget(cfg), "final_train_loss": s["final_train_loss"],
                 "compute_ms": split["compute"], "exchange_ms": split["push"] + split["pull"] + split["wait"]}
        for pt in out.glob("*.pt"):
            pt.unlink()  # the snapshots: only the timings and metrics are kept
    else:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        for stale in ("rendezvous", *(f"result-{r}.json" for r in range(cfg.workers))):
            (out / stale).unlink(missing_ok=True)  # a rerun's rendezvous file must be fresh
        (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
        store = str((out / "rendezvous").resolve()) if arm == "ddp" else ""
        argvs = [[sys.executable, "-c", RUNNER, "--config", str(out / "config.json"), "--rank", str(r),
                  *(["--ddp-store", store] if store else []),
                  *(["--floor", FLOOR_WAIT[arm]] if arm in FLOOR_WAIT else [])]
                 for r in range(cfg.workers)]
        mem = run_processes(argvs, [out / "logs" / f"rank-{r}.log" for r in range(cfg.workers)], tag, timeout)
        results = [json.loads((out / f"result-{r}.json").read_text()) for r in range(cfg.workers)]
        measured = rate_of([r["ends"] for r in results], skip, cfg.batch_size)
        steps = cfg.steps
        extra = {"threads": results[0]["threads"], "final_train_loss": results[0]["final_train_loss"],
                 "compute_ms": statistics.mean(r["compute_s"] for r in results) / steps * 1e3,
                 "exchange_ms": None}
    (out / "rendezvous").unlink(missing_ok=True)
    return {"status": "ok", "run_s": time.perf_counter() - t0, **measured, **extra, **mem}


# -- memory per parameter, counted from the objects -------------------------------------------------------
def held(obj, exclude: tuple = ()) -> tuple[int, list[str]]:
    """Bytes of the tensors `obj` holds as attributes (not those in `exclude`), and their names."""
    import torch

    total, names = 0, []
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor) and not any(value is x for x in exclude):
            total += value.numel() * value.element_size()
            names.append(name)
    return total, names


def per_param(base: RunConfig, local_steps: int = 4) -> dict:
    """Bytes per parameter held after real steps (see the module docstring), for this model."""
    import torch

    from psgd.train import assemble, models

    def one(cfg: RunConfig, steps: int) -> dict:
        server = assemble.shard_server(cfg, 0, "127.0.0.1", 0)
        try:
            exchange = assemble.ps_exchange(cfg, [f"127.0.0.1:{server.port}"])
            parts = assemble.worker_parts(cfg, 0, torch.device("cpu"))
            flat = models.FlatParams(parts.model)
            exchange.setup(flat, 0)
            for clock in range(steps):
                exchange.before_compute(clock, flat)
                flat.zero_grad_once()
                for xb, yb in parts.batches.micro(clock):
                    parts.loss(parts.model(xb), yb).backward()
                flat.zeroed = False
                exchange.after_compute(clock, flat)
            shard = server.shard
            n = shard.param.numel()
            opt_bytes, opt_names = held(shard.opt, (shard.param,))
            worker = {}
            if exchange._local is not None:
                inner, inner_names = held(exchange._local, (flat.params, flat.grads))
                bufs, buf_names = held(exchange, (flat.params, flat.grads))
                worker = {"inner_optimizer_bytes_per_param": inner / n, "inner_optimizer_tensors": inner_names,
                          "worker_bytes_per_param": (inner + bufs + 8 * n) / n,
                          "worker_tensors": ["params", "grads", *inner_names, *buf_names]}
            exchange.close()
        finally:
            server.stop(grace=0)
        return {"params": n, "optimizer": f"{cfg.optim.optimizer}" + (f" (outer {opt_names})" if worker else ""),
                "shard_param_bytes_per_param": shard.param.element_size(),
                "shard_optimizer_bytes_per_param": opt_bytes / n, "shard_optimizer_tensors": opt_names,
                "shard_bytes_per_param": shard.param.element_size() + opt_bytes / n, **worker}

    ps = dataclasses.replace(base, mode="async", workers=1, servers=1, steps=2)
    diloco = dataclasses.replace(base, mode="sync", workers=1, servers=1, steps=2 * local_steps,
                                 local_steps=local_steps, optim=dataclasses.replace(base.optim, outer="nesterov"))
    return {"adamw_shard": one(ps, 2), "diloco": {"local_steps": local_steps, **one(diloco, 2 * local_steps)}}


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
        from psgd.bench.cluster import BENCH_CODE  # noqa: PLC0415 - results/ written meanwhile is no code change

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


def main(argv: list[str]) -> int:
    from psgd.core.config import validate
    from psgd.core.errors import Parser, UsageError
    from psgd.train import data, models, text

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
    p.add_argument("--out", default="results/bench/transformer", help="folder for the JSON, CSV, tables, command")
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
    out, runs = Path(a.out), Path(a.runs)
    out.mkdir(parents=True, exist_ok=True)
    command = "psgd bench transformer " + " ".join(argv)
    started = time.time()
    (out / "command.txt").write_text(f"{command}\n# started {_when(started)}; {_machine()}\n")
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
    memory_run = None
    if not a.no_memory:
        cfg = arm_config(base, "default", runs / "default")
        memory_run = {"command": "psgd run " + " ".join(_changed(cfg)), "status": "ok"}
        try:
            memory_run.update(run_arm("default", cfg, a.skip))
        except (RuntimeError, ValueError, OSError, KeyError) as e:
            memory_run.update(status=f"failed: {e}")
        print(f"memory run: {memory_run.get('peak_rss_sum_mib', 0):.0f} MiB peak RSS summed", flush=True)
    result = {"command": command, "machine": f"{os.cpu_count()} CPU cores shared with other work; CPU only",
              "model": {"width": base.model.width or 128, "layers": a.layers, "heads": a.heads, "block": text.BLOCK,
                        "vocab": text.VOCAB, "params": models.count(base.model, *data.SHAPES["text"])},
              "batch_size": a.batch_size, "lr": a.lr, "steps": a.steps, "skip": a.skip, "rounds": a.rounds,
              "arms": arms, "rows": rows, "summary": summarise(rows), "memory_budget_mib": BUDGET_MIB,
              "memory_run": memory_run, "per_param": None if a.no_memory else per_param(base)}
    print(write_outputs(result, out))
    with open(out / "command.txt", "a") as f:
        f.write(f"# finished {_when(time.time())}, took {time.time() - started:.0f} s; load average "
                f"{os.getloadavg()[0]:.2f}\n")
    print(f"wrote {out / 'transformer.json'}, {out / 'transformer.csv'}, {out / 'TRANSFORMER.md'}, "
          f"{out / 'command.txt'}")
    return 0
