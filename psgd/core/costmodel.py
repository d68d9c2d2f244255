"""Alpha-beta cost model of one training step: parameter server (K shards) vs ring all-reduce.

Contract: pure functions over frozen dataclasses: no gRPC, no processes, no plotting.
`step_time(mode, n, k, machine, work)` returns a `Step`: compute / comm / apply seconds, the
step total, samples per second, and the bytes through the busiest process. `predict` tabulates
it over bandwidths and worker counts; `validate(rows, machine, work)` compares measured step
times with the model's. `psgd model ...` (psgd/bench/costmodel_cli.py) predicts and plots up to 1024
workers; `psgd bench calibrate` (psgd/bench/calibrate.py) fits this machine's numbers.

    psgd bench calibrate && psgd model --bandwidth 10gbit,100gbit,400gbit --workers 8..1024

The model (a message of n bytes costs alpha + n * beta: Hockney 1994; S = model bytes on the
wire, N workers, K shards, gamma = server optimizer seconds per byte):
- PS, K shards (ps-lite key ranges, Li et al. OSDI 2014): every worker pushes S and pulls S
  bytes, S/K to each shard in parallel; the busiest shard takes N*S/K in and sends N*S/K out
  (2*N*S/K per step). A phase ends when the slower of the worker's link (S) and the shard's
  link (N*S/K) is done, and after the per-message software cost of the busier end (a worker
  sends K messages, a shard takes N):
  push = pull = latency + max(K, N) * alpha + max(S, N*S/K) * beta;  apply = (S/K) * gamma.
  sync:  step = compute_max(N) + push + apply + pull  (BSP: each phase waits for the last worker)
  async: no barrier; a worker cycles compute + push + pull, a shard serves one gradient per
         (S/K)(beta + gamma); gradients/s = min(N / cycle, 1 / ((S/K)(beta + gamma))).
- Ring all-reduce (Patarasuk & Yuan 2009): 2(N-1) steps of S/N bytes per rank, one after another:
  comm = 2(N-1) * (latency + alpha) + 2(N-1)/N * S * beta;  apply = S * gamma on every replica.
- Stragglers: each worker's step gets an exponential delay of mean j. Sync PS and the ring wait
  for the slowest of N: E[max] = j * H_N (harmonic number); async waits for nobody: mean j.
- One host (`cores` > 0, this machine): all processes share `cores` CPUs and every transfer is
  a CPU copy through the same memory, so the concurrent transfers of a phase share one "link":
  push = pull = max(K, N)*alpha + N*S*beta (a message per connection); ring = 2(N-1) * alpha +
  2(N-1) * S * beta; compute and apply share the cores. Cluster (`cores` = 0): one process per
  host, full-duplex links, a non-blocking switch.
- Beyond this machine, a link is as fast as the slower of the wire and the software feeding it:
  beta = max(8 / bandwidth, calibrated software beta); alpha (software, per message) stays the
  calibrated one and the wire adds its latency.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MODES = ("sync", "async", "ring")


@dataclass(frozen=True)
class Machine:
    latency_s: float = 0.0             # one-way wire latency (0 on loopback)
    alpha_s: float = 300e-6            # per message: software (gRPC) overhead
    beta_s_per_byte: float = 1e-9      # PS transfer, one direction (1 GB/s)
    ring_alpha_s: float = 100e-6       # collective library (gloo) per message
    ring_beta_s_per_byte: float = 1e-9
    apply_s_per_byte: float = 0.25e-9  # server / replica optimizer step (fused SGD with momentum)
    cores: int = 0                     # 0: one process per host (cluster); C: all on one C-core host


@dataclass(frozen=True)
class Workload:
    params: int = 25_000_000           # model parameters
    wire_bytes: int = 4                # per parameter (fp32)
    batch: int = 32                    # samples per worker per step
    compute_s_fixed: float = 0.0       # forward + backward: fixed part per step ...
    compute_s_per_sample: float = 1e-3  # ... plus this per sample
    jitter_s: float = 0.0              # mean exponential straggler delay per worker per step

    @property
    def size(self) -> float:
        return float(self.params * self.wire_bytes)

    @property
    def compute_s(self) -> float:
        return self.compute_s_fixed + self.compute_s_per_sample * self.batch


@dataclass(frozen=True)
class Step:
    compute_s: float
    comm_s: float
    apply_s: float
    total_s: float
    samples_per_s: float
    busiest_bytes: float   # bytes through the busiest process per step (in + out)


def harmonic(n: int) -> float:
    return sum(1.0 / i for i in range(1, n + 1))


def step_time(mode: str, n: int, k: int, m: Machine, w: Workload) -> Step:
    """One step of `mode` with n workers and k shards (ignored by the ring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if n < 1 or k < 1:
        raise ValueError(f"need n >= 1 and k >= 1, got n={n}, k={k}")
    s = w.size
    share = max(1.0, n / m.cores) if m.cores else 1.0  # CPU contention of n workers on one host
    slowest = w.jitter_s * harmonic(n)                  # E[max of n exponential delays]
    if mode == "ring":
        compute = w.compute_s * share + slowest
        if n == 1:
            comm, busiest = 0.0, 0.0
        else:
            per_rank = 2 * (n - 1) / n * s
            carried = per_rank * n if m.cores else per_rank  # one host: all ranks share one "link"
            comm = 2 * (n - 1) * (m.latency_s + m.ring_alpha_s) + carried * m.ring_beta_s_per_byte
            busiest = 2 * per_rank  # each rank sends and receives per_rank
        apply = s * m.apply_s_per_byte * share
        total = compute + comm + apply
        return Step(compute, comm, apply, total, n * w.batch / total, busiest)
    shard_bytes = n * s / k
    carried = n * s if m.cores else max(s, shard_bytes)
    one_way = m.latency_s + max(k, n) * m.alpha_s + carried * m.beta_s_per_byte
    apply = s / k * m.apply_s_per_byte * (max(1.0, k / m.cores) if m.cores else 1.0)
    if mode == "sync":
        compute = w.compute_s * share + slowest
        comm = 2 * one_way
        total = compute + comm + apply
        return Step(compute, comm, apply, total, n * w.batch / total, max(2 * s, 2 * shard_bytes))
    # async: every worker cycles on its own (on one host their transfers still share the CPUs);
    # the busiest shard serves one gradient at a time and may cap the gradient rate.
    compute = w.compute_s * share + w.jitter_s
    cycle = compute + 2 * (m.latency_s + k * m.alpha_s + (carried if m.cores else s) * m.beta_s_per_byte)
    shard_s = s / k * (m.beta_s_per_byte + m.apply_s_per_byte)
    grads_per_s = min(n / cycle, 1.0 / shard_s)
    total = n / grads_per_s  # seconds per round of n gradients, comparable to a sync step
    return Step(compute, max(0.0, total - compute - apply), apply, total, grads_per_s * w.batch,
                max(2 * s, 2 * shard_bytes))


def at_bandwidth(m: Machine, bits_per_s: float, latency_s: float, software_bound: bool = True) -> Machine:
    """The machine's software on a wire of this speed: the slower of wire and software wins
    (software_bound=False: the wire alone, as if the software kept up with any link)."""
    wire = 8.0 / bits_per_s
    return dataclasses.replace(m, cores=0, latency_s=latency_s,
                               beta_s_per_byte=max(wire, m.beta_s_per_byte) if software_bound else wire,
                               ring_beta_s_per_byte=max(wire, m.ring_beta_s_per_byte) if software_bound else wire)


def validate(rows: list[dict], m: Machine, work: Workload, tolerance: float = 0.25) -> list[dict]:
    """Measured vs predicted step time for rows {mode, workers, shards, step_s, batch}.

    Returns one row per measurement with `predicted_s`, relative `error` and `within`.
    """
    out = []
    for r in rows:
        w = dataclasses.replace(work, batch=int(r.get("batch", work.batch)))
        p = step_time(r["mode"], int(r["workers"]), max(1, int(r.get("shards") or 1)), m, w)
        err = (p.total_s - r["step_s"]) / r["step_s"]
        out.append({**r, "predicted_s": p.total_s, "predicted_compute_s": p.compute_s,
                    "predicted_comm_s": p.comm_s, "error": err, "within": abs(err) <= tolerance})
    return out


def parse_workers(text: str) -> list[int]:
    """"8..1024" -> 8, 16, ..., 1024 (powers of two); "1,2,4" -> [1, 2, 4]."""
    text = text.strip()
    if ".." in text:
        lo, hi = (int(v) for v in text.split(".."))
        if lo < 1 or hi < lo:
            raise ValueError(f"--workers LO..HI needs 1 <= LO <= HI, got {text!r}")
        out, v = [], lo
        while v <= hi:
            out.append(v)
            v *= 2
        return out
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"--workers needs integers >= 1, got {text!r}")
    return values


def predict(m: Machine, w: Workload, bandwidths: list[tuple[str, float, float]], workers: list[int],
            shards: list[str], software_bound: bool = True) -> list[dict]:
    """Rows for every (bandwidth, N, mode/K): shards entries are ints or "N" (one shard per worker)."""
    rows = []
    for name, bits, latency in bandwidths:
        mb = at_bandwidth(m, bits, latency, software_bound)
        for n in workers:
            configs = [("ring", 1, "-")] + [("sync", n if s == "N" else int(s), s) for s in shards]
            for mode, k, label in configs:
                st = step_time(mode, n, k, mb, w)
                rows.append({"bandwidth": name, "workers": n, "mode": mode, "shards": k if mode != "ring" else 0,
                             "shards_label": label,
                             "step_s": st.total_s, "compute_s": st.compute_s, "comm_s": st.comm_s,
                             "apply_s": st.apply_s, "samples_per_s": st.samples_per_s,
                             "busiest_bytes": st.busiest_bytes})
    return rows


def machine_from_dict(d: dict) -> Machine:
    """A Machine from `psgd bench calibrate`'s JSON (unknown keys ignored)."""
    known = {f.name for f in dataclasses.fields(Machine)}
    return Machine(**{k: v for k, v in d.items() if k in known})


def workload_from_dict(d: dict) -> Workload:
    known = {f.name for f in dataclasses.fields(Workload)}
    return Workload(**{k: v for k, v in d.items() if k in known})
