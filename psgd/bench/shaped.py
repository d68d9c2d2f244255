"""What the benchmarks on kernel-shaped links share: a cluster per rate, its calibration, the cost model on it.

Contract (used by `psgd bench cluster`, psgd/bench/cluster.py, and `psgd bench utilisation`,
psgd/bench/utilisation.py):
- `shaped(name, hosts, link)`: a `psgd cluster` up for the block and always down after it, also on
  a failure, Ctrl-C or SIGTERM; `cluster_name(prefix, rate)` names one per rate; `check_rates`
  refuses a rate that is not finite or gives no cluster name (ValueError, one line).
- `calibration(out, a, c)`: `psgd bench calibrate` across cluster c's shaped link (h1, the shard on
  h0), or on loopback with c None; `host_calibration` the one-host one (made now, or --calibration's
  file, refused when for another --width). Either failing is a `BenchFailed` naming the command.
- `machines(across, host, latency_s, goodput_bits)`: the cost model (psgd/core/costmodel.py) on
  the cluster in its two forms, each a floor under the step.
- `add_cluster_flags(p, name, repeat)`: the flags of all of the above. Needs root to run (netns).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

from psgd.bench.transport import MIB
from psgd.cluster import netns, plan
from psgd.core import costmodel as cm
from psgd.core import link as link_mod

__all__ = ["BenchFailed", "CALIBRATE_TIMEOUT_S", "cluster_name", "shaped", "calibration_sizes", "calibration",
           "host_calibration", "check_rates", "add_cluster_flags", "machines"]

CALIBRATE_TIMEOUT_S = 600.0


class BenchFailed(RuntimeError):
    """A calibration failed, or was for another width; the message says which."""


def cluster_name(prefix: str, rate: str) -> str:
    """A cluster name of its own per rate: "bc" + "1gbit" -> "bc1gbit" (plan.NAME's letters only)."""
    name = prefix + re.sub(r"[^a-z0-9]", "", rate.lower().replace(".", "p"))
    if not plan.NAME.fullmatch(name):
        raise ValueError(f"--name {prefix!r} with rate {rate!r} gives {name!r}: not a cluster name (plan.NAME)")
    return name


@contextlib.contextmanager
def shaped(name: str, hosts: int, link: str):
    """A cluster up for the block, and down after it whatever happened (SIGTERM too: it raises)."""
    with netns.signals_raise():
        c = netns.up(name, hosts, link)
        try:
            yield c
        finally:
            netns.down(name, kill=True)


def calibration_sizes(a: argparse.Namespace, c: plan.Cluster | None) -> str:
    """--sizes-mb, or with "auto" two sizes 4x apart, the smaller 2 MiB or 4x the link's tbf bucket:
    a message no larger than the bucket crosses at the veth's speed, not the link's (measured: a fit
    on 2 and 8 MiB gave 13 Gbit/s through a 10gbit link, whose bucket holds 2.5 MB)."""
    if a.sizes_mb != "auto":
        return a.sizes_mb
    small = max(2, math.ceil(4 * c.shaped.burst / MIB)) if c and c.shaped else 2
    return f"{small},{4 * small}"


def calibration(out: Path, a: argparse.Namespace, c: plan.Cluster | None = None) -> dict:
    """`psgd bench calibrate` (psgd/bench/calibrate.py) at --width over tcp, its JSON: on h1 of cluster c
    with the shard on h0 (the PS across the shaped link), or with c None on loopback, ring included
    (the model's one-host form)."""
    cmd = [sys.executable, "-m", "psgd", "bench", "calibrate", "--transport", "tcp", "--width", str(a.width),
           "--sizes-mb", calibration_sizes(a, c), "--repeat", str(a.repeat), "--out", str(out)]
    argv = plan.exec_argv(c, "h1", [*cmd, "--cluster", c.name, "--shard-host", "h0", "--no-ring"]) if c else cmd
    r = subprocess.run(argv, capture_output=True, text=True, timeout=CALIBRATE_TIMEOUT_S)
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        raise BenchFailed(f"`{' '.join(argv[-20:])}` failed: {lines[-1] if lines else r.returncode}")
    return json.loads(out.read_text())


def host_calibration(out: Path, a: argparse.Namespace) -> dict:
    """The one-host calibration: --calibration's file, or made on loopback now (OUT/calibration-loopback.json);
    BenchFailed when it is for another --width."""
    host = json.loads(Path(a.calibration).read_text()) if a.calibration else \
        calibration(out / "calibration-loopback.json", a)
    if host.get("model", {}).get("width") != a.width:
        raise BenchFailed(f"--calibration {a.calibration} is for width {host.get('model', {}).get('width')}, "
                          f"not --width {a.width}")
    return host


def check_rates(rates: list[str], latency: str, prefix: str) -> None:
    """ValueError unless every rate is a finite link rate that gives a cluster name with `prefix`."""
    for rate in rates:
        lk = link_mod.parse(f"{rate},{latency}")
        if lk is None or lk.bits_per_s == float("inf"):
            raise ValueError(f"--rates needs finite rates, got {rate!r}")
        cluster_name(prefix, rate)


def add_cluster_flags(p: argparse.ArgumentParser, name: str, repeat: int) -> None:
    """The flags of `calibration`, `host_calibration`, the link probe, the clusters' names and the retries
    (this bench's and `psgd bench utilisation`'s)."""
    p.add_argument("--sizes-mb", default="auto", help="calibration: push / pull sizes to fit beta on, MiB (auto: "
                   "2 and 8, or 4x and 16x a link's tbf bucket where that is more)")
    p.add_argument("--repeat", type=int, default=repeat, help="calibration: timed repetitions per size")
    p.add_argument("--calibration", default="", help="the one-host calibration (psgd bench calibrate --transport "
                   "tcp, same --width) for the model's CPU floor; default: made in this run "
                   "(OUT/calibration-loopback.json)")
    p.add_argument("--probe-s", type=float, default=1.0, help="the raw TCP probe moves this many seconds of the rate")
    p.add_argument("--name", default=name, help="cluster name prefix (the rate is appended)")
    p.add_argument("--retries", type=int, default=1, help="rerun a failed configuration this many times")


def machines(across: dict, host: dict, latency_s: float, goodput_bits: float) -> dict[str, cm.Machine]:
    """The cost model on the cluster, two ways (psgd/core/costmodel.py).
    "ps" and "ring": its cluster form (cores = 0: a CPU and a full-duplex link per host), the PS's
    alpha, beta and apply fitted across the shaped link (`across`; beta no faster than the link's
    raw TCP goodput: a fit can see tbf's burst), the ring's beta that goodput (gloo moves bytes from
    C++, as the probe does) and no latency (gloo's sockets are not paced and this kernel has no
    netem: hosts.link_record), its alpha the one-host fit's.
    "cpu": its one-host form (`host`, fitted on loopback: every process on these `cores`, every
    transfer a copy through them): what the shared cores allow, whatever the link. Each form is a
    floor under the step; `predict` takes the higher."""
    m, h = across["machine"], host["machine"]
    wire = 8.0 / goodput_bits
    ps = cm.Machine(latency_s=latency_s, alpha_s=max(0.0, m["alpha_s"]),
                    beta_s_per_byte=max(m["beta_s_per_byte"], wire), apply_s_per_byte=m["apply_s_per_byte"],
                    ring_alpha_s=h.get("ring_alpha_s", cm.Machine.ring_alpha_s), ring_beta_s_per_byte=wire, cores=0)
    return {"ps": ps, "ring": dataclasses.replace(ps, latency_s=0.0), "cpu": cm.machine_from_dict(h)}
