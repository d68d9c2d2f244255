"""`psgd bench allreduce`: the library's all-reduce against the hand-written ring, same bytes.

Contract: for each N in `--workers`, start N processes (torch.multiprocessing spawn, a file://
rendezvous in a temporary folder, nccl when every rank gets its own GPU, else gloo on 127.0.0.1).
For each `--size-mb` and `--impl`, every rank first checks the result (rank r contributes r+1
everywhere, every element must come back as N(N+1)/2), then runs `--warmup` untimed and
`--iters` timed all-reduces of one fp32 buffer, each started together after a barrier. Reported,
with the definitions of nccl-tests (doc/PERFORMANCE.md):

    time    mean seconds per all-reduce, of the slowest rank (the collective ends when it does)
    algbw   size / time
    busbw   algbw x 2(N-1)/N: the bytes each rank's link carries in a ring per second, which
            makes runs with different N comparable, and comparable to the link's peak bandwidth
    sent    bytes one rank sent: exact for the ring, 2(N-1)/N x size (the ring's) for the library

and the ring/library time ratio per N and size. MiB = 2**20 bytes (as --bucket-mb); GB/s = 1e9
bytes/s (as nccl-tests). A table by default, JSON with --json; `--out FILE` also writes the JSON
(with the command that made it) to FILE, as `psgd bench transport --out` does. Exit 2 on bad
flags, 1 if a run fails. Figures are measured side by side in one run; nothing here asserts a speed.

    psgd bench allreduce --size-mb 100 --workers 2,4 --impl library,ring
    psgd bench allreduce --size-mb 1,10,100 --workers 2 --json
    psgd bench allreduce --out results/bench/allreduce.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from psgd.allreduce.collective import choose_backend, usable_cuda_devices
from psgd.allreduce.ring import ring_all_reduce, ring_bytes

MIB = 1 << 20
IMPLS = ("library", "ring")


def bus_bandwidth(algbw: float, n: int) -> float:
    """nccl-tests' busbw of an all-reduce: algbw x 2(N-1)/N."""
    return algbw * 2 * (n - 1) / n


def _csv(kind, name: str):
    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} wants a comma-separated list, got {text!r}") from None
    return parse


def build_parser():
    from psgd.core.errors import Parser

    p = Parser(prog="psgd bench allreduce", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=_csv(float, "--size-mb"), default=[100.0], help="buffer sizes, MiB (list)")
    p.add_argument("--workers", type=_csv(int, "--workers"), default=[2, 4], help="group sizes N (list)")
    p.add_argument("--impl", type=_csv(str, "--impl"), default=list(IMPLS), help="library,ring (list)")
    p.add_argument("--iters", type=int, default=5, help="timed all-reduces per point")
    p.add_argument("--warmup", type=int, default=1, help="untimed all-reduces first")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="auto: nccl with one CUDA device per rank, else gloo")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per group before it counts as hung")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--out", default="", metavar="FILE", help="also write the JSON result to this file")
    return p


def validate(a: argparse.Namespace) -> None:
    from psgd.core.errors import UsageError

    problems = [
        (bool(a.size_mb) and all(s > 0 for s in a.size_mb), f"--size-mb must be > 0, got {a.size_mb}"),
        (bool(a.workers) and all(n >= 2 for n in a.workers), f"--workers needs group sizes >= 2, got {a.workers}"),
        (bool(a.impl) and all(i in IMPLS for i in a.impl), f"--impl must be a list of {', '.join(IMPLS)}"),
        (a.iters >= 1, f"--iters must be >= 1, got {a.iters}"),
        (a.warmup >= 0, f"--warmup must be >= 0, got {a.warmup}"),
        (a.timeout > 0, f"--timeout must be > 0, got {a.timeout}"),
        # Refused before the ranks start, not after minutes of measuring.
        (not (a.out and Path(a.out).is_dir()), f"--out wants a file, {a.out!r} is a folder"),
    ]
    for ok, message in problems:
        if not ok:
            raise UsageError(message)
    for n in a.workers:
        choose_backend(a.backend, "auto", n, usable_cuda_devices())  # UsageError for nccl without GPUs


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    validate(a)
    rows = []
    try:
        for n in a.workers:
            rows += run_group(n, a)
    except BenchFailed as e:
        print(f"psgd bench allreduce: failed: {e}", file=sys.stderr)
        return 1
    result = {"benchmark": "allreduce", "rows": rows, "ratios": ratios(rows)}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        command = "psgd bench allreduce " + " ".join(argv)
        Path(a.out).write_text(json.dumps({**result, "command": command}, indent=1))
    print(json.dumps(result, indent=1) if a.json else format_table(rows, a.iters))
    return 0


class BenchFailed(RuntimeError):
    """A rank failed or the group timed out; one line."""


def run_group(n: int, a: argparse.Namespace) -> list[dict]:
    """Spawn N ranks, measure every (size, impl), return rank 0's rows."""
    backend = choose_backend(a.backend, "auto", n, usable_cuda_devices())
    spec = dict(sizes=a.size_mb, impls=a.impl, iters=a.iters, warmup=a.warmup, timeout=a.timeout, backend=backend)
    with tempfile.TemporaryDirectory(prefix="psgd-bench-") as tmp:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only; inherited by the ranks
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        ctx = mp.start_processes(_rank_main, args=(n, spec, tmp), nprocs=n, join=False, start_method="spawn")
        deadline = time.monotonic() + a.timeout + 60  # the collectives time out first; this is a backstop
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise BenchFailed(f"N={n}: the ranks did not finish within {a.timeout + 60:.0f}s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            raise BenchFailed(f"N={n}: {lines[-1] if lines else e}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        return json.loads((Path(tmp) / "rows.json").read_text())


def _rank_main(rank: int, n: int, spec: dict, tmp: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # N processes share the cores; one intra-op thread each
    nccl = spec["backend"] == "nccl"
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group(spec["backend"], init_method=f"file://{tmp}/rdv", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=spec["timeout"]),
                            **({"device_id": device} if nccl else {}))

    def sync() -> None:
        if nccl:
            torch.cuda.synchronize(device)

    def library(buf: torch.Tensor) -> int:
        dist.all_reduce(buf)
        return ring_bytes(buf.numel(), n, 4)  # an estimate: the library does not report its traffic

    def ring(buf: torch.Tensor) -> int:
        return ring_all_reduce(buf).sent

    ops = {"library": library, "ring": ring}
    rows = []
    for size_mb in spec["sizes"]:
        buf = torch.empty(max(1, int(size_mb * MIB) // 4), device=device)
        for impl in spec["impls"]:
            op = ops[impl]
            buf.fill_(rank + 1)
            op(buf)
            sync()
            expected = n * (n + 1) / 2
            if not bool((buf == expected).all()):
                raise AssertionError(f"{impl} all-reduce of {size_mb} MiB on N={n} gave a wrong sum")
            buf.zero_()  # repeated sums of zeros stay finite however many iterations run
            for _ in range(spec["warmup"]):
                op(buf)
            sync()
            elapsed, sent = 0.0, 0
            for _ in range(spec["iters"]):
                dist.barrier()  # start together: time the collective, not the ranks' arrival skew
                sync()
                t0 = time.perf_counter()
                sent = op(buf)
                sync()
                elapsed += time.perf_counter() - t0
            slowest = torch.tensor([elapsed / spec["iters"]], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            seconds = float(slowest)
            nbytes = buf.numel() * 4
            algbw = nbytes / seconds / 1e9
            rows.append(dict(impl=impl, workers=n, backend=spec["backend"], size_mb=size_mb, bytes=nbytes,
                             time_ms=seconds * 1e3, algbw_GBps=algbw, busbw_GBps=bus_bandwidth(algbw, n),
                             sent_bytes_per_rank=sent, sent_estimated=impl == "library", correct=True))
        del buf
    dist.barrier()
    if rank == 0:
        (Path(tmp) / "rows.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def ratios(rows: list[dict]) -> list[dict]:
    """ring time / library time for every (N, size) that has both."""
    by = {(r["workers"], r["size_mb"], r["impl"]): r["time_ms"] for r in rows}
    return [{"workers": n, "size_mb": s, "ring_over_library": by[(n, s, "ring")] / by[(n, s, "library")]}
            for (n, s, impl) in by if impl == "library" and (n, s, "ring") in by]


def format_table(rows: list[dict], iters: int) -> str:
    backends = ", ".join(sorted({r["backend"] for r in rows}))
    lines = [f"all-reduce of fp32 buffers ({backends}); time: slowest rank's mean of {iters}; "
             "busbw = algbw x 2(N-1)/N (nccl-tests)",
             f"{'impl':<8} {'N':>3} {'size MiB':>9} {'time ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} "
             f"{'sent MiB/rank':>14}"]
    for r in rows:
        lines.append(f"{r['impl']:<8} {r['workers']:>3} {r['size_mb']:>9g} {r['time_ms']:>10.2f} "
                     f"{r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f} {r['sent_bytes_per_rank'] / MIB:>13.2f}"
                     f"{'~' if r['sent_estimated'] else ' '}")
    for q in ratios(rows):
        lines.append(f"ring / library time, N={q['workers']}, {q['size_mb']:g} MiB: {q['ring_over_library']:.2f}x")
    if any(r["sent_estimated"] for r in rows):
        lines.append("~ estimated: the textbook ring traffic; the library does not report its own")
    return "\n".join(lines)
