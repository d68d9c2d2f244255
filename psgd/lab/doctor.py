"""`psgd doctor [--gpu]`: what this host offers, and with --gpu (`make gpu-check`) a bounded check of psgd on its GPUs.

Contract:
- `psgd doctor` prints torch, CUDA and the GPUs torch sees; exit 0.
- `psgd doctor --gpu` on a host where torch sees no CUDA device prints that it checked nothing and
  exits 0, writing nothing. With one or more GPUs it runs, each step a process bounded by its own
  timeout and all of them by `--budget-s` (default 300 s; a step with under 10 s left fails as
  not run):
    gpu-tests          pytest -m gpu (tests marked gpu: tests/test_gpu.py), outcome per test
    sync-cpu, sync-gpu the same sync PS run, 2 workers x 2 shards, on the CPU and on the GPU(s);
                       every worker's loss at every step must agree within LOSS_RTOL (below)
    overlap-gpu        the GPU run again with --overlap: same losses within the same tolerance
    bench-transport    psgd bench transport --device cuda (pushes and pulls of device tensors)
    with 2 or more GPUs, also:
    nccl-e5            E5's benchmark on NCCL: psgd bench allreduce --backend nccl, the library
                       against the hand-written ring (the NCCL all-reduce equivalence test is one
                       of the gpu-tests, marked gpu(devices=2))
  It writes OUT/gpu-check.json (host, versions, every step's command, outcome, seconds and
  figures) and OUT/SUMMARY.md (the same, short, with the device name), default OUT results/tmp/gpu
  (git-ignored; make gpu-check names results/gpu); exit 1 if any step failed.

The CPU-vs-GPU tolerance. With 2 workers a sync shard's sum of the two gradients is the same in
either arrival order (fp addition commutes; only 3 or more terms depend on order), so two CPU runs
agree bit for bit (measured: two runs of RUN below, 80 (rank, clock) losses, max difference 0.0),
and any CPU-vs-GPU difference is the GPU's own float32 rounding: cuBLAS and the loss kernels sum in
other orders (TF32 is off for fp32 matmuls by default; the JSON records it). That is about 1e-7
relative per operation, compounding over 40 steps to orders below 1e-4. What a broken GPU worker
does (a stale or half-copied parameter vector, a gradient sent before its copy finished) moves a
loss by at least one update's effect on it, and does so again at every step: one SGD update of this
run moves its batch's loss by about 4e-3 of it (measured on the CPU: median 3.9e-3, smallest 2.8e-3
over 40 steps). So LOSS_RTOL = 5e-4 of |loss| (plus LOSS_ATOL = 1e-6, for losses near 0): over
100x the expected rounding, over 5x below the smallest error a bug makes. The JSON keeps the
largest difference seen, so the margin can be read off each GPU host.

    make gpu-check                      # = psgd doctor --gpu --out results/gpu
    psgd doctor --gpu --budget-s 300 --out /tmp/gpu
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from psgd.core.errors import Parser, UsageError

LOSS_RTOL = 5e-4
LOSS_ATOL = 1e-6
MIN_STEP_S = 10.0  # a step given less than this is not started: it fails as "not run, out of time"
RUN = ["--mode", "sync", "--workers", "2", "--servers", "2", "--model", "mlp", "--dataset", "synthetic",
       "--steps", "40", "--batch-size", "32", "--eval-every", "0", "--quiet"]


class CheckFailed(Exception):
    """A step ran but what it produced is wrong; one line."""


def environment() -> dict:
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    return {
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda_build": torch.version.cuda, "cuda_available": cuda, "gpus": count,
        "gpu_names": [torch.cuda.get_device_name(k) for k in range(count)],
        "nccl": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
    }


def step_losses(run: Path) -> dict[tuple[int, int], float]:
    """(rank, clock) -> loss of every step event in RUN/metrics.jsonl."""
    lines = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip())
    return {(e["rank"], e["clock"]): e["loss"] for e in lines if e.get("event") == "step"}


def compare_losses(a: dict, b: dict, rtol: float = LOSS_RTOL, atol: float = LOSS_ATOL) -> dict:
    """Every (rank, clock) of `a` in `b`, and |a - b| <= atol + rtol |a| at each; CheckFailed naming the worst."""
    if set(a) != set(b) or not a:
        raise CheckFailed(f"the runs logged different steps ({len(a)} vs {len(b)} (rank, clock) pairs)")
    worst = max(a, key=lambda k: abs(a[k] - b[k]) - rtol * abs(a[k]))
    figures = {"steps_compared": len(a), "max_abs_diff": max(abs(a[k] - b[k]) for k in a),
               "max_rel_diff": max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-30) for k in a), "rtol": rtol, "atol": atol}
    if abs(a[worst] - b[worst]) > atol + rtol * abs(a[worst]):
        raise CheckFailed(f"worker {worst[0]} step {worst[1]}: loss {a[worst]:.7g} vs {b[worst]:.7g}, beyond "
                          f"{atol:g} + {rtol:g} x |loss|")
    return figures


def _run(argv: list[str], timeout: float, log: Path) -> None:
    """Run argv as its own process group, output to `log`; kill the group past the timeout.
    CheckFailed on a non-zero exit or a timeout, with the log's last line."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call started: the command and its children
            proc.wait()
            raise CheckFailed(f"did not finish within {timeout:.0f}s") from None
    if rc != 0:
        last = [ln for ln in log.read_text().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise CheckFailed(f"exit code {rc}: {last[0][:300]}")


class Doctor:
    """Runs the GPU steps in order under one deadline; collects what each did."""

    def __init__(self, work: Path, budget_s: float) -> None:
        self.work, self.deadline = work, time.monotonic() + budget_s
        self.steps: list[dict] = []

    def step(self, name: str, argv: list[str], timeout: float, check: Callable[[], dict] | None = None) -> bool:
        left = self.deadline - time.monotonic()
        record: dict = {"name": name, "command": " ".join(argv[2:] if argv[:2] == [sys.executable, "-m"] else argv)}
        t0 = time.monotonic()
        try:
            if left < MIN_STEP_S:
                raise CheckFailed(f"not run: {left:.0f}s left of the budget")
            _run(argv, min(timeout, left), self.work / f"{name}.log")
            record.update(check() if check else {})
            record["passed"] = True
        except (CheckFailed, OSError, ValueError, KeyError) as e:
            record.update(passed=False, error=str(e) or type(e).__name__, log_tail=_tail(self.work / f"{name}.log"))
        record["seconds"] = round(time.monotonic() - t0, 1)
        print(f"  {'ok  ' if record['passed'] else 'FAIL'} {name} ({record['seconds']:.0f}s)"
              + ("" if record["passed"] else f": {record['error']}"), flush=True)
        self.steps.append(record)
        return record["passed"]


def _tail(log: Path, lines: int = 20) -> list[str]:
    """The last lines of a step's output, kept in the JSON when it failed (the work folder is temporary)."""
    return log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []


def psgd(*args: str) -> list[str]:
    return [sys.executable, "-m", "psgd", *args]


def gpu_check(env: dict, work: Path, budget_s: float) -> list[dict]:
    d = Doctor(work, budget_s)
    xml = work / "gpu-tests.xml"
    d.step("gpu-tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-n", "0",
                         f"--junitxml={xml}", "tests"], 150, lambda: {"tests": junit_outcomes(xml)})
    runs = {name: work / name for name in ("sync-cpu", "sync-gpu", "overlap-gpu")}
    d.step("sync-cpu", psgd("run", *RUN, "--device", "cpu", "--out", str(runs["sync-cpu"])), 90)
    d.step("sync-gpu", psgd("run", *RUN, "--device", "cuda", "--out", str(runs["sync-gpu"])), 90,
           lambda: gpu_run_figures(runs["sync-gpu"], runs["sync-cpu"]))
    d.step("overlap-gpu", psgd("run", *RUN, "--device", "cuda", "--overlap", "--out", str(runs["overlap-gpu"])), 90,
           lambda: gpu_run_figures(runs["overlap-gpu"], runs["sync-cpu"]))
    bench = work / "bench-transport.json"
    d.step("bench-transport", psgd("bench", "transport", "--device", "cuda", "--size-mb", "16", "--shards", "1,2",
                                   "--repeat", "3", "--small-params", "0", "--out", str(bench)), 120,
           lambda: {"rows": [{k: r[k] for k in ("transport", "shards", "device", "push_gbps", "pull_gbps")}
                             for r in json.loads(bench.read_text())["psgd"]]})
    if env["gpus"] >= 2:
        e5 = work / "e5-allreduce.json"
        d.step("nccl-e5", psgd("bench", "allreduce", "--backend", "nccl", "--workers", "2", "--size-mb", "1,25",
                               "--impl", "library,ring", "--iters", "5", "--out", str(e5)), 120,
               lambda: {"ratios": json.loads(e5.read_text())["ratios"]})
    return d.steps


def gpu_run_figures(run: Path, cpu_run: Path) -> dict:
    """A GPU run's workers are on CUDA devices, and its losses match the CPU run's (compare_losses)."""
    s = json.loads((run / "summary.json").read_text())
    devices = {r: w["device"] for r, w in s["worker_devices"].items()}
    if not all(d.startswith("cuda") for d in devices.values()):
        raise CheckFailed(f"workers not on a GPU: {devices}")
    return {"worker_devices": devices, "device_names": sorted({w["device_name"] for w in s["worker_devices"].values()}),
            "time_breakdown_s": s["time_breakdown_s"], "samples_per_s": s["samples_per_s"],
            "vs_cpu": compare_losses(step_losses(cpu_run), step_losses(run))}


def junit_outcomes(xml: Path) -> dict:
    """test name -> passed | failed: message | skipped: reason, from pytest's --junitxml."""
    import xml.etree.ElementTree as ET

    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        found = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcomes[name] = "passed" if found is None else f"{found.tag}: {(found.get('message') or '')[:200]}"
    if not outcomes:
        raise CheckFailed("no test marked gpu was collected")
    return outcomes


def summary_markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# make gpu-check: {'passed' if report['passed'] else 'FAILED'}", "",
             f"`{report['command']}`, {report['date']}, {report['seconds']:.0f} s on {env['host']}: "
             f"{env['gpus']} x {', '.join(sorted(set(env['gpu_names'])))}; torch {env['torch']}, "
             f"CUDA {env['cuda_build']}, "
             f"Python {env['python']}, NCCL {'yes' if env['nccl'] else 'no'}, TF32 matmul {env['tf32_matmul']}.", "",
             f"CPU vs GPU: every worker's loss at every step within {LOSS_ATOL:g} + {LOSS_RTOL:g} x |loss| "
             "(psgd/lab/doctor.py says why).", "", "| step | outcome | s | detail |", "|---|---|---|---|"]
    for s in report["steps"]:
        detail = s.get("error") or ", ".join(f"{k} {v}" for k, v in s.items() if k in ("vs_cpu", "ratios", "rows"))
        lines.append(f"| {s['name']} | {'ok' if s['passed'] else '**FAIL**'} | {s['seconds']:.0f} | "
                     f"{str(detail)[:400]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = Parser(prog="psgd doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="check psgd on this host's GPUs (what make gpu-check runs)")
    p.add_argument("--out", default="results/tmp/gpu", help="where --gpu writes gpu-check.json and SUMMARY.md "
                                                            "(default: results/tmp/gpu, git-ignored)")
    p.add_argument("--budget-s", type=float, default=300.0, help="--gpu: seconds for all steps together (default 300)")
    a = p.parse_args(argv)
    if a.budget_s <= 0:
        raise UsageError(f"--budget-s must be > 0, got {a.budget_s}")
    env = environment()
    print(f"torch {env['torch']} (CUDA build: {env['cuda_build'] or 'none'}), Python {env['python']}; "
          f"GPUs: {', '.join(env['gpu_names']) or 'none that torch sees'}")
    if not a.gpu:
        return 0
    if env["gpus"] == 0:
        print("psgd doctor --gpu: no CUDA GPU here (torch.cuda.is_available() is False): checked nothing, "
              "wrote nothing; run it on a GPU host")
        return 0
    if not Path("tests").is_dir():
        raise UsageError("psgd doctor --gpu runs the gpu-marked tests: run it from the repository root "
                         "(make gpu-check)")
    t0 = time.monotonic()
    print(f"psgd doctor --gpu: {env['gpus']} GPU(s), budget {a.budget_s:.0f}s", flush=True)
    with tempfile.TemporaryDirectory(prefix="psgd-doctor-") as tmp:
        steps = gpu_check(env, Path(tmp), a.budget_s)
    report = {"command": "psgd doctor " + " ".join(argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
              "seconds": time.monotonic() - t0, "passed": all(s["passed"] for s in steps),
              "loss_tolerance": {"rtol": LOSS_RTOL, "atol": LOSS_ATOL}, "environment": env, "steps": steps}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    (out / "SUMMARY.md").write_text(summary_markdown(report))
    print(f"{'passed' if report['passed'] else 'FAILED'}: {out}/gpu-check.json, {out}/SUMMARY.md")
    return 0 if report["passed"] else 1
