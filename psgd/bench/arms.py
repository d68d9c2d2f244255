"""The arms of `psgd bench transformer` (and `psgd bench roundtrip`): one run of one arm, and what is measured of it.

Contract (the benchmark's own is psgd/bench/transformer.py's docstring): `run_arm` runs one arm
from its config (transformer.py `arm_config`) in fresh processes, psgd's through `psgd run` and the
torch arms (`plain`, `ddp`, the floors) through `child` (`torch_loop`, or psgd/bench/floor.py),
and returns its fields: samples/s in the steady state (`rate_of`, from each rank's step-end times),
compute and exchange per step, and the peak memory of every process of the arm (`run_processes`
under a `MemoryPoll`, the processes found by their TAG). `per_param`: bytes per parameter held,
counted from the tensors the objects hold after real steps. Nothing here imports
psgd.bench.transformer, which imports these names from here (and keeps them importable from there).
"""

from __future__ import annotations

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
from psgd.core.config import RunConfig, from_dict, to_argv, to_dict

FLOOR_WAIT = {"floor": "block", "floor-spin": "spin", "floor-rows": "block"}  # floor.py's arms; rowfloor.py's
# The children run transformer.py's name for `child` (the same command line, so the same `command`
# in every memory row as before this module was split out of transformer.py).
# The arm's process ends with os._exit once its result is written: torch's DDP on gloo can abort in the
# interpreter's teardown ("terminate called without an active exception", SIGABRT; seen once in 45
# DDP arms of a 5-round roundtrip bench) after the work and its result are done.
RUNNER = ("import os, sys; from psgd.bench.transformer import child; rc = child(sys.argv[1:]); "
          "sys.stdout.flush(); sys.stderr.flush(); os._exit(rc)")
TAG = "PSGD_BENCH_TRANSFORMER"  # in every process of an arm (inherited): how the memory poll finds them


# -- the metric: steady-state rates from step-end times -------------------------------------------------------
def steady_rate(ends: list[float], skip: int) -> tuple[float, float, int]:
    """(steps/s at the median step, steps/s over the window, steps timed) from one rank's
    step-end times (see psgd/bench/transformer.py's docstring)."""
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
def torch_loop(cfg: RunConfig, rank: int, ddp_store: str = "", sparse_tables: bool = False) -> dict:
    """The plain loop (no `ddp_store`) or one DDP rank: psgd's batches and model, torch's AdamW (or SGD).
    `sparse_tables`: the model's nn.Embedding tables give sparse gradients (`sparse=True`, which torch's
    SGD steps row by row): psgd bench roundtrip's `plain-sparse`, the tighter ceiling of a row path."""
    import torch
    from torch import distributed as dist

    from psgd.train import assemble, threads

    torch.set_num_threads(threads.thread_budget(cfg))
    parts = assemble.worker_parts(cfg, rank, torch.device("cpu"))
    model, loss_fn = parts.model, parts.loss
    tables = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    for m in tables:
        m.sparse = sparse_tables
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
            "compute_s": compute_s, "sparse_tables": len(tables) if sparse_tables else 0}


def make_optimizer(params, cfg: RunConfig):
    """torch's own optimizer of `cfg` over `params`: SGD (psgd bench roundtrip's MLP, what a shard's
    update computes) or AdamW."""
    import torch

    o = cfg.optim
    if o.optimizer == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def child(argv: list[str]) -> int:
    """`python -c RUNNER --config C --rank R [--ddp-store PATH | --floor WAIT [--rows]]`: one torch arm's process."""
    import argparse

    p = argparse.ArgumentParser(prog="psgd.bench.transformer child")
    p.add_argument("--config", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--ddp-store", default="")
    p.add_argument("--floor", choices=("block", "spin"), help="a floor arm (psgd/bench/floor.py), its wait")
    p.add_argument("--sparse-tables", action="store_true", help="the plain-sparse arm (torch_loop)")
    p.add_argument("--rows", action="store_true", help="with --floor: the row floor (psgd/bench/rowfloor.py)")
    a = p.parse_args(argv)
    cfg = from_dict(json.loads(Path(a.config).read_text()))
    if a.floor:
        from psgd.bench.floor import floor_loop
        from psgd.bench.rowfloor import row_floor_loop

        result = (row_floor_loop if a.rows else floor_loop)(cfg, make_optimizer, a.floor)
    else:
        result = torch_loop(cfg, a.rank, a.ddp_store, a.sparse_tables)
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
    from psgd.train import supervise

    env = dict(supervise.child_env(), **{TAG: tag})
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
        from psgd.train import threads

        extra = {"threads": threads.thread_budget(cfg), "final_train_loss": s["final_train_loss"],
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
                  *(["--floor", FLOOR_WAIT[arm]] if arm in FLOOR_WAIT else []),
                  *(["--sparse-tables"] if arm == "plain-sparse" else []), *(["--rows"] if arm == "floor-rows" else [])]
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
    """Bytes per parameter held after real steps (see psgd/bench/transformer.py's docstring), for this model."""
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
