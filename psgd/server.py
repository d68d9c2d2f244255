"""gRPC servicer for one parameter shard: stores and moves bytes; `consistency.py` decides when.

Contract (service `psgd.v1.ParameterShard`, see protos/):
- `Init`: the first caller's values become the shard's parameters (later calls are no-ops);
  pushes are refused (FAILED_PRECONDITION) and pulls wait until then.
- `Push`: header + chunks of one gradient. A wrong worker id, shard, dtype or length, a
  protocol violation (clock) or a non-finite value is refused with INVALID_ARGUMENT and
  changes nothing (with `--skip-nonfinite` a non-finite gradient is counted and skipped). The
  policy buffers or applies it; the reply says `done` once the run's budget is spent.
- `Pull`: held by the policy (sync / SSP), then header + chunks of the parameters.
- Every update is a real `torch.optim.SGD` step on the shard tensor (momentum, weight decay,
  linear warmup), so a sync run reproduces single-process training.
- Snapshots of the parameters are kept every `--eval-every` updates (and at 0 and the end);
  they are evaluated after the run (psgd/evaluate.py), so evaluation never disturbs timing.

Locking: the policy's condition (`self.policy.cond`) is the one lock of the servicer; it guards
the parameters, the optimizer, the snapshots and the counters. The policy calls `_apply` and
the pull's read callback with it held. Decoding and streaming happen outside it.

Run one by hand:  psgd server --port 50051 --shard 0 --servers 2 --workers 4 --mode sync
"""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

from psgd import codec
from psgd._proto import parameter_server_pb2 as pb
from psgd._proto import parameter_server_pb2_grpc as pb_grpc
from psgd.config import RunConfig
from psgd.consistency import PolicyError, PullTimeout, make_policy

DTYPE_NAMES = {pb.FP32: "fp32", pb.FP16: "fp16", pb.BF16: "bf16"}
DTYPE_ENUMS = {v: k for k, v in DTYPE_NAMES.items()}


class ShardServicer(pb_grpc.ParameterShardServicer):
    def __init__(self, cfg: RunConfig, shard: int) -> None:
        assert 0 <= shard < cfg.servers, f"shard {shard} out of range for {cfg.servers} shards"
        self.cfg, self.shard = cfg, shard
        self.policy = make_policy(cfg.mode, cfg.workers, self._apply, cfg.staleness, cfg.budget)
        self.param: torch.Tensor | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.ready = threading.Event()
        self.snapshots: list[tuple[int, float, torch.Tensor]] = []  # (version, unix time, params)
        self.bytes_in = 0
        self.bytes_out = 0
        self.apply_s = 0.0

    # -- state changes (policy lock held) ----------------------------------------------------
    def _apply(self, grad: torch.Tensor) -> None:
        start = time.perf_counter()
        assert self.param is not None and self.opt is not None
        warmup = self.cfg.optim.warmup
        if warmup:
            # Linear warmup from lr/warmup to lr over `warmup` updates (Goyal et al. 2017, sec. 2.2).
            for group in self.opt.param_groups:
                group["lr"] = self.cfg.optim.lr * min(1.0, (self.policy.version + 1) / warmup)
        self.param.grad = grad
        self.opt.step()
        version = self.policy.version + 1  # the policy bumps its counter right after we return
        if self.cfg.eval_every and version % self.cfg.eval_every == 0:
            self.snapshots.append((version, time.time(), self.param.detach().clone()))
        self.apply_s += time.perf_counter() - start

    # -- RPCs ----------------------------------------------------------------------------------
    def Init(self, request_iterator, context):
        header, data = self._receive(request_iterator, context, expected_len=None)
        with self.policy.cond:
            if self.param is None:
                self.param = data
                self.opt = torch.optim.SGD([self.param], lr=self.cfg.optim.lr, momentum=self.cfg.optim.momentum,
                                           weight_decay=self.cfg.optim.weight_decay)
                self.snapshots.append((0, time.time(), data.clone()))
                self.ready.set()
                return pb.InitReply(version=self.policy.version, initialized_by_caller=True)
            if data.numel() != self.param.numel():
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"shard {self.shard} holds {self.param.numel()} elements; Init sent {data.numel()}")
            return pb.InitReply(version=self.policy.version, initialized_by_caller=False)

    def Push(self, request_iterator, context):
        if not self.ready.is_set():
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.shard} is not initialised yet")
        header, grad = self._receive(request_iterator, context, expected_len=self.param.numel())
        skipped = False
        if not bool(torch.isfinite(grad).all()):
            if not self.cfg.skip_nonfinite:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"non-finite gradient from worker {header.worker_id} at clock {header.clock} "
                              "refused (run servers with --skip-nonfinite to skip such gradients)")
            skipped = True
        try:
            out = self.policy.push(header.worker_id, header.clock, header.base_version, None if skipped else grad)
        except PolicyError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.PushReply(version=out.version, applied=out.applied, skipped=out.skipped, done=out.done,
                            staleness=out.staleness, refused=out.refused)

    def Pull(self, request, context):
        if request.shard != self.shard:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"pull for shard {request.shard} sent to shard {self.shard}")
        dtype = DTYPE_NAMES.get(request.dtype)
        if dtype is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown wire dtype {request.dtype}")
        timeout = context.time_remaining()
        if not self.ready.wait(timeout):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"shard {self.shard} was never initialised")
        wire = codec.WIRE_DTYPES[dtype]

        def read() -> torch.Tensor:
            # Copy under the lock (a conversion for fp16/bf16 is the copy); encode outside it.
            return self.param.detach().to(wire) if wire != torch.float32 else self.param.detach().clone()

        try:
            out = self.policy.pull(request.worker_id, request.clock, read, context.time_remaining())
        except PolicyError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except PullTimeout as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        n = 0 if out.value is None else out.value.numel()
        yield pb.PullChunk(header=pb.PullHeader(version=out.version, num_elements=n, dtype=request.dtype,
                                                done=out.done, wait_s=out.wait_s, clock_gap=out.clock_gap))
        if out.value is not None:
            buf = codec.encode(out.value, dtype)
            self.bytes_out += len(buf)  # approximate under concurrency; reported, not relied on
            for chunk in codec.iter_chunks(buf):
                yield pb.PullChunk(data=chunk)

    def Info(self, request, context):
        return pb.InfoReply(shard=self.shard, num_shards=self.cfg.servers, num_workers=self.cfg.workers,
                            mode=self.cfg.mode, version=self.policy.version, initialized=self.ready.is_set(),
                            num_elements=0 if self.param is None else self.param.numel())

    # -- helpers ---------------------------------------------------------------------------------
    def _receive(self, request_iterator, context, expected_len: int | None):
        """Read header + data chunks; validate everything before any state changes."""
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stream must start with a header")
        h = first.header
        dtype = DTYPE_NAMES.get(h.dtype)
        problems = [
            (dtype is None, f"unknown wire dtype {h.dtype}"),
            (h.shard != self.shard, f"tensor for shard {h.shard} sent to shard {self.shard}"),
            (h.worker_id >= self.cfg.workers, f"worker id {h.worker_id} out of range 0..{self.cfg.workers - 1}"),
            (expected_len is not None and h.num_elements != expected_len,
             f"shard {self.shard} has {expected_len} elements, header says {h.num_elements}"),
        ]
        for bad, message in problems:
            if bad:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        asm = codec.Assembler(h.num_elements, dtype)
        try:
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "data":
                    raise ValueError("a second header inside one stream")
                asm.add(msg.data)
            data = asm.finish()
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.bytes_in += asm.received
        return h, data

    def stats(self) -> dict:
        s = self.policy.stats
        with self.policy.cond:
            return {
                "shard": self.shard, "version": self.policy.version, "accepted": self.policy.accepted,
                "staleness_hist": {str(k): v for k, v in sorted(s.staleness.items())},
                "clock_gap_hist": {str(k): v for k, v in sorted(s.gaps.items())},
                "max_clock_gap": s.max_clock_gap, "skipped_nonfinite": s.skipped_nonfinite,
                "refused_after_budget": s.refused_after_budget, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "apply_s": self.apply_s,
                "num_elements": 0 if self.param is None else self.param.numel(),
            }

    def save(self, out: Path) -> None:
        """Write shard-K.json (stats) and shard-K.pt (snapshots incl. the final parameters)."""
        with self.policy.cond:
            snaps = list(self.snapshots)
            if self.param is not None and (not snaps or snaps[-1][0] != self.policy.version):
                snaps.append((self.policy.version, time.time(), self.param.detach().clone()))
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"shard": self.shard, "snapshots": snaps}, out / f"shard-{self.shard}.pt")
        (out / f"shard-{self.shard}.json").write_text(json.dumps(self.stats(), indent=1))


def create_server(cfg: RunConfig, shard: int, host: str = "127.0.0.1", port: int = 0):
    """Start a shard server; returns (grpc server, servicer, bound port). Raises OSError if the port is taken."""
    servicer = ShardServicer(cfg, shard)
    # Pulls may be held by the policy, one thread each: leave room for every worker's pull and push.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4 * cfg.workers + 8),
                         options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ParameterShardServicer_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}: the port is in use or the address is not this host's")
    server.start()
    return server, servicer, bound


def stop(server: grpc.Server, servicer: ShardServicer, grace: float = 1.0) -> None:
    """Release held pulls (they return done), then stop serving."""
    servicer.policy.close()
    server.stop(grace).wait()
