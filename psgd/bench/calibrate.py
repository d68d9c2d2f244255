"""`psgd bench calibrate`: fit the cost model's numbers (psgd/core/costmodel.py) on this machine.

Contract: measures, then writes `--out` (default results/tmp/bench/calibration.json) with the fitted
`machine` and `workload` (what `psgd model` and `psgd bench scaling` read), every raw point and
the exact command:
- PS transport (psgd push / pull against one shard over `--transport`, grpc or tcp,
  psgd/bench/transport.py): alpha = median
  one-way time of a tiny message (push and pull of 1 KiB); beta = least-squares slope of
  one-way time vs bytes over `--sizes-mb` (push without the shard's optimizer step, and pull).
- server apply: slope of the shard's optimizer-step time vs bytes (gamma).
- ring: `psgd bench allreduce`'s library all-reduce, N = 2, at the same sizes: with N = 2 the
  ring time is 2 alpha + S beta (Patarasuk & Yuan 2009), fitted by least squares.
- compute: forward + backward of the scaling sweep's model (`--model wide_mlp --width W`) on
  one thread, as a worker runs it, at batch 8, 32, 64: time = fixed + per_sample * batch.
- cores: the CPUs this process may run on (all of psgd's processes share them here).

On a `psgd cluster` (`--cluster NAME --shard-host H`, run on another host of it) the PS fit is
across the hosts: the shard on host H, bound to its address, this process the client, so every
byte crosses both hosts' kernel-shaped links (no latency is added: a kernel without netem has
none, and the model adds the link's own as latency_s). The ring is not fitted there (`--no-ring`):
its ranks would meet on this host's loopback. The JSON then names the cluster and its link.

    psgd bench calibrate                          # about a minute
    psgd bench calibrate --sizes-mb 1,4,16 --repeat 3 --no-ring
    psgd cluster exec h1 -- psgd bench calibrate --cluster lab --shard-host h0 --no-ring
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from psgd.bench import record, transport
from psgd.bench.transport import MIB
from psgd.train import hosts


def fit_line(x: list[float], y: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x; returns (a, b, r^2)."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    b, a = np.polyfit(xs, ys, 1)
    resid = ys - (a + b * xs)
    total = float(((ys - ys.mean()) ** 2).sum())
    return float(a), float(b), 1.0 - float((resid ** 2).sum()) / total if total > 0 else 1.0


def measure_ps(sizes_mb: list[float], repeat: int, transport_name: str = "grpc",
               seat: hosts.Seat = transport.LOOPBACK) -> dict:
    points = []
    for mb in sizes_mb:
        n = max(1, int(mb * MIB) // 4)
        m = transport.measure_push_pull(1, n, repeat, transport_name, seat=seat)
        points.append({"bytes": 4 * n, "push_net_s": max(0.0, m["push_s"] - m["apply_s"]), **m})
    tiny = transport.measure_push_pull(1, 256, max(20, repeat * 4), transport_name, seat=seat)
    x = [p["bytes"] for p in points] * 2
    y = [p["push_net_s"] for p in points] + [p["pull_s"] for p in points]
    _, beta, r2 = fit_line(x, y)
    _, gamma, r2_apply = fit_line([p["bytes"] for p in points], [p["apply_s"] for p in points])
    # The tiny push's own apply is the fitted slope times its 1 KiB (microseconds): the shard's mean
    # apply time would also count its first apply, which allocates and warms up (measured: 7 ms of
    # a mean whose pushes took 0.5 ms, on a loaded machine), and make alpha negative.
    alpha = (tiny["push_s"] - max(gamma, 0.0) * 1024 + tiny["pull_s"]) / 2
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "r2": r2, "apply_s_per_byte": max(gamma, 0.0),
            "r2_apply": r2_apply, "points": points, "tiny": tiny}


def measure_ring(sizes_mb: list[float], repeat: int) -> dict:
    from psgd.bench import allreduce

    args = allreduce.build_parser().parse_args(
        ["--workers", "2", "--impl", "library", "--iters", str(repeat),
         "--size-mb", ",".join(str(s) for s in [0.001, *sizes_mb])])
    allreduce.validate(args)
    rows = allreduce.run_group(2, args)
    big = [r for r in rows if r["size_mb"] >= min(sizes_mb)]
    a, b, r2 = fit_line([r["bytes"] for r in big], [r["time_ms"] / 1e3 for r in big])
    tiny = next(r for r in rows if r["size_mb"] == 0.001)["time_ms"] / 1e3
    # N = 2: the ring moves S once each way in 2 steps, 2 alpha + S beta.
    return {"ring_alpha_s": tiny / 2, "ring_beta_s_per_byte": b, "r2": r2, "intercept_s": a, "points": rows}


def measure_compute(width: int, batches: tuple[int, ...] = (8, 32, 64), repeat: int = 5) -> dict:
    from psgd.core.config import DataConfig, ModelConfig
    from psgd.train import data, models

    torch.set_num_threads(1)  # a worker process runs with OMP_NUM_THREADS=1 (supervise.child_env)
    ds = data.load(DataConfig())
    model = models.build(ModelConfig(model="wide_mlp", width=width), ds.input_dim, ds.num_classes, seed=0)
    models.FlatParams(model)
    times = []
    for b in batches:
        x, y = ds.x_train[:b], ds.y_train[:b]
        samples = []
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples[1:]))
    fixed, per_sample, r2 = fit_line(list(batches), times)
    return {"params": models.num_params(model), "compute_s_fixed": max(fixed, 0.0),
            "compute_s_per_sample": per_sample, "r2": r2, "batches": list(batches), "seconds": times}


def shard_seat(cluster: str, shard_host: str) -> tuple[hosts.Seat, dict]:
    """The shard's seat on host `shard_host` of `cluster` (this process must run on another of its
    hosts), and what the JSON records of it; UsageError saying what to run otherwise."""
    from psgd.cluster import netns
    from psgd.core.errors import UsageError
    from psgd.ps import auth

    netns.need_privileges()
    c = netns.load(cluster)
    if c is None or not c.complete:
        raise UsageError(f"--cluster {cluster}: no complete cluster of that name is up (psgd cluster up --name "
                         f"{cluster} --hosts 2 --link RATE)")
    try:
        shard = c.host(shard_host)
    except ValueError as e:
        raise UsageError(str(e)) from None
    here = netns.host_here(c)
    if here is None or here == shard:
        other = next(h for h in c.hosts if h != shard) if len(c.hosts) > 1 else None
        raise UsageError(f"--cluster {cluster}: run this on a host of the cluster other than the shard's "
                         + (f"(psgd cluster exec {other.name} --name {cluster} -- psgd bench calibrate ...)" if other
                            else f"(cluster {cluster!r} has one host: make one with two)"))
    token = ((auth.ENV, secrets.token_hex(32)),) if not os.environ.get(auth.ENV) else ()  # off loopback: a token
    seat = hosts.Seat(("ip", "netns", "exec", shard.namespace), bind=shard.address, env=token)
    return seat, {"name": c.name, "link": c.link or "unshaped", "latency_by": c.latency_by,
                  "shard": f"{shard.name} {shard.address}", "client": f"{here.name} {here.address}"}


def calibrate(sizes_mb: list[float], repeat: int, width: int, ring: bool, transport_name: str = "grpc",
              seat: hosts.Seat = transport.LOOPBACK) -> dict:
    ps = measure_ps(sizes_mb, repeat, transport_name, seat)
    rg = measure_ring(sizes_mb, repeat) if ring else None
    comp = measure_compute(width)
    machine = {"alpha_s": ps["alpha_s"], "beta_s_per_byte": ps["beta_s_per_byte"],
               "apply_s_per_byte": ps["apply_s_per_byte"], "cores": len(os.sched_getaffinity(0))}
    if rg:
        machine.update(ring_alpha_s=rg["ring_alpha_s"], ring_beta_s_per_byte=rg["ring_beta_s_per_byte"])
    workload = {"params": comp["params"], "wire_bytes": 4, "batch": 32,
                "compute_s_fixed": comp["compute_s_fixed"], "compute_s_per_sample": comp["compute_s_per_sample"]}
    return {"machine": machine, "workload": workload, "model": {"model": "wide_mlp", "width": width},
            "transport": transport_name,
            "fits": {"ps": ps, "ring": rg, "compute": comp}}


def summary(c: dict) -> str:
    m, w, f = c["machine"], c["workload"], c["fits"]
    on = c.get("cluster")
    where = f", across cluster {on['name']!r} ({on['link']}): shard on {on['shard']}, client on {on['client']}" \
        if on else ""
    lines = [f"PS transport ({c.get('transport', 'grpc')}{where}): alpha {m['alpha_s'] * 1e3:.3f} ms, "
             f"beta {m['beta_s_per_byte'] * 1e9:.3f} ns/B "
             f"({1 / m['beta_s_per_byte'] / 1e9:.2f} GB/s), r^2 {f['ps']['r2']:.3f}",
             f"server apply: {m['apply_s_per_byte'] * 1e9:.3f} ns/B ({1 / max(m['apply_s_per_byte'], 1e-15) / 1e9:.2f}"
             f" GB/s), r^2 {f['ps']['r2_apply']:.3f}"]
    if f["ring"]:
        lines.append(f"ring (library, N=2): alpha {m['ring_alpha_s'] * 1e3:.3f} ms, beta "
                     f"{m['ring_beta_s_per_byte'] * 1e9:.3f} ns/B ({1 / m['ring_beta_s_per_byte'] / 1e9:.2f} GB/s), "
                     f"r^2 {f['ring']['r2']:.3f}")
    lines.append(f"compute (wide_mlp width {c['model']['width']}, {w['params'] / 1e6:.1f}M params, 1 thread): "
                 f"{w['compute_s_fixed'] * 1e3:.1f} ms + {w['compute_s_per_sample'] * 1e3:.2f} ms/sample, "
                 f"r^2 {f['compute']['r2']:.3f}; cores {m['cores']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd bench calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="1,4,16,64", help="transfer sizes to fit beta on, MiB")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions per point (median)")
    p.add_argument("--width", type=int, default=3500, help="wide_mlp width of the compute fit (scaling's model)")
    p.add_argument("--ring", action=argparse.BooleanOptionalAction, default=True,
                   help="also fit the library all-reduce (N=2)")
    p.add_argument("--transport", default="grpc", choices=("grpc", "tcp"),
                   help="the PS transport whose alpha and beta to fit (psgd/ps/tcp_server.py for tcp)")
    p.add_argument("--cluster", default="", help="fit the PS transport across the hosts of this psgd cluster: the "
                   "shard on --shard-host, this process (run on another host: psgd cluster exec) the client")
    p.add_argument("--shard-host", default="h0", help="with --cluster: the shard's host (default: %(default)s)")
    p.add_argument("--out", default=record.scratch("bench/calibration.json"),
                   help="where to write the fit (default: %(default)s, git-ignored; psgd model, bench scaling and "
                        "bench scale read it while it is newer than the committed results/bench/calibration.json)")
    a = p.parse_args(argv)
    try:
        sizes = [float(v) for v in a.sizes_mb.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--sizes-mb expects comma-separated numbers, got {a.sizes_mb!r}") from None
    if len(sizes) < 2 or min(sizes) <= 0 or a.repeat < 1 or a.width < 1:
        raise UsageError("--sizes-mb needs at least two sizes > 0; --repeat and --width must be >= 1")
    seat, where = shard_seat(a.cluster, a.shard_host) if a.cluster else (transport.LOOPBACK, None)
    if a.cluster and a.ring:
        raise UsageError("--cluster fits the PS transport across hosts only: add --no-ring (the ring's ranks would "
                         "meet on this host's loopback)")
    result = calibrate(sizes, a.repeat, a.width, a.ring, a.transport, seat)
    if where:
        result["cluster"] = where
    result["command"] = "psgd bench calibrate " + " ".join(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(summary(result))
    print(f"wrote {out}")
    return 0
