"""One parameter shard: stores and moves bytes; `consistency.py` decides when.

Contract (service `psgd.v1.ParameterShard`, see protos/):
- `Init`: the first caller's values become the shard's parameters (later calls are no-ops);
  pushes are refused (FAILED_PRECONDITION) and pulls wait until then.
- `Push`: header + chunks of one gradient. A wrong worker id, shard, dtype or length, a
  protocol violation (clock) or a non-finite value is refused with INVALID_ARGUMENT and
  changes nothing (with `--skip-nonfinite` a non-finite gradient is counted and skipped). The
  policy buffers or applies it; the reply says `done` once the run's budget is spent.
- `Pull`: held by the policy (sync / SSP), then header + chunks of the parameters.
- Every update is a real `torch.optim.SGD` step on the shard tensor (momentum, weight decay,
  linear warmup), so a sync run reproduces single-process training. With `--local-steps H` > 1
  (sync only) a push is a worker's model delta after H local steps and the update is
  w <- w - mean(delta), the replicas' average (psgd/core/localsgd.py); the budget counts pushes.
- Start barrier: every worker's first pull (clock 0) is held until all N workers asked for it
  (psgd/core/consistency.py), so no worker trains before the last one has started.
- Snapshots of the parameters are kept every `--eval-every` updates (and at 0 and the end);
  they are evaluated after the run (psgd/train/evaluate.py), so evaluation never disturbs timing.

Two transports, one core: `check_header`, `require_ready`, `push_received`, `pull_values` and
`init_received` hold every check and state change and raise `ShardError(status, message)`; the
gRPC methods below (`aborts` turns a ShardError into the RPC's status) and the raw-TCP data
plane (psgd/ps/tcp.py, started by `create_server` on a port of its own, told to workers by `Info`)
only move bytes in and out around them.

Locking: the policy's condition (`self.policy.cond`) is the one lock of the servicer; it guards
the parameters, the optimizer, the snapshots and the counters. The policy calls `_apply` and
the pull's read callback with it held. Decoding and streaming happen outside it. The pool of
receive buffers is a `queue.SimpleQueue`, thread-safe on its own.

Data path (each copy counted, see docs/architecture.md): a push is written chunk by chunk into a
reused fp32 scratch buffer straight from gRPC's bytes (`codec.data_view`, no protobuf copy),
checked for finiteness, handed to the policy, and the buffer goes back to the pool. A pull
copies the parameters once, under the lock, into ready-serialised frames (`codec.frames`) that
gRPC sends as they are. `create_server` registers the servicer with these frame-aware
(de)serialisers; the bytes on the wire are exactly the protobuf messages of the .proto.

Run one by hand:  psgd server --port 50051 --shard 0 --servers 2 --workers 4 --mode sync
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import queue
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd._proto import parameter_server_pb2_grpc as pb_grpc
from psgd.core import codec, link, localsgd
from psgd.core.config import RunConfig
from psgd.core.consistency import PolicyError, PullTimeout, make_policy

DTYPE_NAMES = {pb.FP32: "fp32", pb.FP16: "fp16", pb.BF16: "bf16"}
DTYPE_ENUMS = {v: k for k, v in DTYPE_NAMES.items()}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
SERVICE = pb.DESCRIPTOR.services_by_name["ParameterShard"].full_name
# Both ends: admit one data frame (gRPC's default cap is 4 MiB per message).
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES)]


class ShardError(Exception):
    """A request refused by the shard: a gRPC status code and a one-line message (no state changed)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@contextlib.contextmanager
def aborts(context: grpc.ServicerContext):
    """Turn a ShardError into the RPC's status: the client sees the code and the message."""
    try:
        yield
    except ShardError as e:
        context.abort(e.code, e.message)


class ShardServicer(pb_grpc.ParameterShardServicer):
    def __init__(self, cfg: RunConfig, shard: int) -> None:
        assert 0 <= shard < cfg.servers, f"shard {shard} out of range for {cfg.servers} shards"
        self.cfg, self.shard = cfg, shard
        # Local SGD (--local-steps H > 1, sync only): a push is a worker's model delta at the end
        # of an averaging round, and the budget counts rounds x N pushes (psgd/core/localsgd.py).
        self.local_sgd = cfg.local_steps > 1
        budget = localsgd.rounds(cfg.steps, cfg.local_steps) * cfg.workers
        # The start barrier: every worker's first pull waits for the last worker to arrive, so no
        # gradient is computed (or applied) before every worker has started up.
        self.policy = make_policy(cfg.mode, cfg.workers, self._apply, cfg.staleness, budget, start_barrier=True)
        self.param: torch.Tensor | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.ready = threading.Event()
        self.data_plane = None  # psgd.ps.tcp.DataServer, started by create_server
        self.data_port = 0      # its port, told to workers by Info
        self.snapshots: list[tuple[int, float, torch.Tensor]] = []  # (version, unix time, params)
        self.bytes_in = 0
        self.bytes_out = 0
        self.apply_s = 0.0
        # --link: the shard's own NIC, emulated (psgd/core/link.py): its pushes in and pulls out share
        # the bandwidth, as N workers' traffic shares one server's link. Latency is the worker's.
        lk = link.parse(cfg.link)
        self.link_in = link.Pacer(lk) if lk else None
        self.link_out = link.Pacer(lk) if lk else None
        # Scratch buffers (received gradients, pull snapshots) per dtype, reused across RPCs: a
        # fresh 64 MiB tensor costs ~3x a copy into a warm one here (page faults), and
        # concurrent RPCs each need their own.
        self._pools: dict[torch.dtype, queue.SimpleQueue[torch.Tensor]] = {
            dt: queue.SimpleQueue() for dt in codec.WIRE_DTYPES.values()}

    # -- state changes (policy lock held) ----------------------------------------------------
    def _apply(self, grad: torch.Tensor) -> None:
        start = time.perf_counter()
        assert self.param is not None and self.opt is not None
        if self.cfg.optim.warmup and not self.local_sgd:  # local SGD: the workers' optimizers warm up
            for group in self.opt.param_groups:
                group["lr"] = localsgd.warmup_lr(self.cfg.optim, self.policy.version)
        self.param.grad = grad
        self.opt.step()
        self.param.grad = None  # the gradient's buffer goes back to the pool after the push
        version = self.policy.version + 1  # the policy bumps its counter right after we return
        if self.cfg.eval_every and version % self.cfg.eval_every == 0:
            self.snapshots.append((version, time.time(), self.param.detach().clone()))
        self.apply_s += time.perf_counter() - start

    # -- the transport-free core: gRPC (below) and the TCP data plane (psgd/ps/tcp.py) call these --
    def check_header(self, h: pb.TensorHeader, expected_len: int | None) -> str:
        """Validate a Push / Init header before any byte of data is read; returns its dtype name."""
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
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, message)
        return dtype

    def require_ready(self) -> int:
        """The shard's length; FAILED_PRECONDITION before Init (pushes are refused until then)."""
        if not self.ready.is_set():
            raise ShardError(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.shard} is not initialised yet")
        return self.param.numel()

    def push_received(self, h: pb.TensorHeader, grad: torch.Tensor) -> pb.PushReply:
        """Hand one received gradient (header already checked) to the policy; the caller owns `grad`."""
        skipped = False
        if not all_finite(grad):
            if not self.cfg.skip_nonfinite:
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"non-finite gradient from worker {h.worker_id} at clock {h.clock} refused "
                                 "(run servers with --skip-nonfinite to skip such gradients)")
            skipped = True
        try:
            out = self.policy.push(h.worker_id, h.clock, h.base_version, None if skipped else grad)
        except PolicyError as e:
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        self.bytes_in += h.num_elements * codec.itemsize(DTYPE_NAMES[h.dtype])  # approximate, reported only
        return pb.PushReply(version=out.version, applied=out.applied, skipped=out.skipped, done=out.done,
                            staleness=out.staleness, refused=out.refused)

    def pull_values(self, request: pb.PullRequest, timeout: float | None) -> tuple[pb.PullHeader, torch.Tensor | None]:
        """Wait for the policy, then (header, a snapshot of the parameters in the wire dtype).

        The snapshot is None when the run is done; otherwise it is a pool buffer that the caller
        sends and then hands back with `release`. The copy under the lock goes into it
        (converting for fp16 / bf16), so a concurrent update never tears what a worker receives.
        """
        if request.shard != self.shard:
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"pull for shard {request.shard} sent to shard {self.shard}")
        dtype = DTYPE_NAMES.get(request.dtype)
        if dtype is None:
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown wire dtype {request.dtype}")
        if not self.ready.wait(timeout):
            raise ShardError(grpc.StatusCode.DEADLINE_EXCEEDED, f"shard {self.shard} was never initialised")
        snap = self.borrow(codec.WIRE_DTYPES[dtype])

        def read() -> torch.Tensor:
            return snap.copy_(self.param.detach())

        try:
            out = self.policy.pull(request.worker_id, request.clock, read, timeout)
        except (PolicyError, PullTimeout) as e:
            self.release(snap)
            timed_out = isinstance(e, PullTimeout)
            raise ShardError(grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.INVALID_ARGUMENT,
                             str(e)) from None
        if out.value is None:
            self.release(snap)
            snap = None
        else:
            self.bytes_out += snap.numel() * snap.element_size()  # approximate under concurrency, reported only
        header = pb.PullHeader(version=out.version, num_elements=0 if snap is None else snap.numel(),
                               dtype=request.dtype, done=out.done, wait_s=out.wait_s, clock_gap=out.clock_gap)
        return header, snap

    def init_received(self, data: torch.Tensor) -> pb.InitReply:
        """The first caller's values become the parameters; later calls only check the length."""
        with self.policy.cond:
            if self.param is None:
                self.param = data
                self.opt = make_optimizer(self.param, self.cfg)
                self.snapshots.append((0, time.time(), data.clone()))
                self.ready.set()
                return pb.InitReply(version=self.policy.version, initialized_by_caller=True)
            if data.numel() != self.param.numel():
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"shard {self.shard} holds {self.param.numel()} elements; Init sent {data.numel()}")
            return pb.InitReply(version=self.policy.version, initialized_by_caller=False)

    def borrow(self, dtype: torch.dtype) -> torch.Tensor:
        """A scratch tensor of the shard's length from the pool (new when all are in use)."""
        try:
            return self._pools[dtype].get_nowait()
        except queue.Empty:
            return torch.empty(self.param.numel(), dtype=dtype)

    def release(self, buf: torch.Tensor) -> None:
        """Hand a `borrow`ed buffer back for the next RPC."""
        self._pools[buf.dtype].put(buf)

    # -- RPCs: gRPC in and out around the core --------------------------------------------------
    def Init(self, request_iterator, context):
        with aborts(context):
            _, data = self._receive(request_iterator, expected_len=None)
            return self.init_received(data)

    def Push(self, request_iterator, context):
        with aborts(context):
            n = self.require_ready()
            buf = self.borrow(torch.float32)
            try:
                header, grad = self._receive(request_iterator, expected_len=n, out=buf)
                return self.push_received(header, grad)
            finally:
                # The policy has applied, summed or cloned the gradient by now: the buffer is free.
                self.release(buf)

    def Pull(self, request, context):
        with aborts(context):
            header, snap = self.pull_values(request, context.time_remaining())
        yield pb.PullChunk(header=header)
        if snap is None:
            return
        # Framing outside the lock, one chunk at a time, overlaps the copy with sending and lets
        # malloc reuse one frame's memory for the next (measured: ~30% less server CPU than
        # framing all chunks under the lock).
        try:
            if self.link_out:
                self.link_out.start(latency=False)
            for frame in codec.frames(codec.encode(snap, DTYPE_NAMES[request.dtype])):
                if self.link_out:
                    self.link_out.pace(len(frame))
                yield frame
        finally:
            self.release(snap)

    def Info(self, request, context):
        return pb.InfoReply(shard=self.shard, num_shards=self.cfg.servers, num_workers=self.cfg.workers,
                            mode=self.cfg.mode, version=self.policy.version, initialized=self.ready.is_set(),
                            num_elements=0 if self.param is None else self.param.numel(),
                            data_port=self.data_port)

    # -- helpers ---------------------------------------------------------------------------------
    def _receive(self, request_iterator, expected_len: int | None, out: torch.Tensor | None = None):
        """Read header + data chunks into `out` (or a new tensor); validate before any state changes."""
        first = next(request_iterator, None)
        if first is None or isinstance(first, memoryview) or first.WhichOneof("kind") != "header":
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, "stream must start with a header")
        h = first.header
        dtype = self.check_header(h, expected_len)
        asm = codec.Assembler(h.num_elements, dtype, out=out)
        if self.link_in:
            self.link_in.start(latency=False)
        try:
            for msg in request_iterator:
                if isinstance(msg, memoryview):  # a data frame, parsed without a copy
                    data = msg
                elif msg.WhichOneof("kind") == "data":
                    data = msg.data
                else:
                    raise ValueError("a second header inside one stream")
                if self.link_in:
                    self.link_in.pace(len(data))
                asm.add(data)
            data = asm.finish()
        except ValueError as e:
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
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


def reuse_freed_memory() -> None:
    """Ask glibc to keep freed multi-MiB blocks for reuse instead of returning them to the OS.

    Every chunk gRPC hands us (and every frame we build) is a fresh 1 MiB `bytes`; by default
    glibc serves blocks that size with mmap and unmaps them on free, so each one page-faults
    afresh. Raising the mmap threshold to its maximum (32 MiB) and the trim threshold keeps them
    in the heap: the client's CPU per 64 MiB pull fell from ~52 to ~40 ms here. Process-wide
    and idempotent; a no-op where libc has no mallopt (not glibc).
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


def all_finite(t: torch.Tensor) -> bool:
    """True when no element is NaN or +-inf.

    A finite sum implies finite elements (NaN and inf propagate through addition), and a sum
    costs one pass without temporaries where `isfinite(t).all()` builds a bool tensor: 5 ms vs
    100 ms for 64 MiB here. Only a non-finite sum (or one that overflowed) takes the exact test.
    """
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def make_optimizer(param: torch.Tensor, cfg: RunConfig) -> torch.optim.Optimizer:
    """torch.optim.SGD over the shard; the fused CPU kernel (one pass, 14 vs 22 ms for 16M
    elements here) where this torch has it, the same update up to float rounding.

    With local SGD the shard's step is the outer one of the averaging: SGD with lr 1, no momentum,
    no weight decay (and no warmup) applied to mean(delta) = w - mean(w_local) makes w the average
    of the workers' replicas, as FedAvg and local SGD average them. The run's lr, momentum, weight
    decay and warmup act in the workers' local optimizers, which take the actual SGD steps."""
    if cfg.local_steps > 1:
        kw = dict(lr=1.0, momentum=0.0, weight_decay=0.0)
    else:
        kw = dict(lr=cfg.optim.lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    try:
        return torch.optim.SGD([param], fused=True, **kw)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.SGD([param], **kw)


def _parse_tensor_chunk(message: bytes):
    """Push / Init request deserialiser: a data frame as a zero-copy view, anything else parsed."""
    view = codec.data_view(message)
    return view if view is not None else pb.TensorChunk.FromString(message)


def _serialize_pull_chunk(message) -> bytes:
    """Pull response serialiser: frames from codec.frames are sent as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def rpc_handlers(servicer: ShardServicer) -> grpc.GenericRpcHandler:
    """The ParameterShard service with frame-aware (de)serialisers for the tensor streams."""
    replies = {"Init": pb.InitReply, "Push": pb.PushReply}
    methods = {name: grpc.stream_unary_rpc_method_handler(getattr(servicer, name), _parse_tensor_chunk,
                                                          reply.SerializeToString)
               for name, reply in replies.items()}
    methods["Pull"] = grpc.unary_stream_rpc_method_handler(servicer.Pull, pb.PullRequest.FromString,
                                                           _serialize_pull_chunk)
    methods["Info"] = grpc.unary_unary_rpc_method_handler(servicer.Info, pb.InfoRequest.FromString,
                                                          pb.InfoReply.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def create_server(cfg: RunConfig, shard: int, host: str = "127.0.0.1", port: int = 0):
    """Start a shard server and its TCP data plane (psgd/ps/tcp.py, a port of its own on `host`);
    returns (grpc server, servicer, bound gRPC port). Raises OSError if the port is taken."""
    reuse_freed_memory()
    servicer = ShardServicer(cfg, shard)
    # Pulls may be held by the policy, one thread each: leave room for every worker's pull and push.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4 * cfg.workers + 8),
                         options=[("grpc.so_reuseport", 0), *CHANNEL_OPTIONS])
    server.add_generic_rpc_handlers((rpc_handlers(servicer),))
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}: the port is in use or the address is not this host's")
    server.start()
    from psgd.ps.tcp import DataServer  # noqa: PLC0415 - tcp builds on this module

    try:
        servicer.data_plane = DataServer(servicer, host)
    except OSError as e:
        server.stop(0)
        raise OSError(f"cannot open the TCP data plane on {host}: {e}") from None
    servicer.data_port = servicer.data_plane.port
    return server, servicer, bound


def stop(server: grpc.Server, servicer: ShardServicer, grace: float = 1.0) -> None:
    """Release held pulls (they return done), then stop serving on both transports."""
    servicer.policy.close()
    if servicer.data_plane is not None:
        servicer.data_plane.stop()
    server.stop(grace).wait()
