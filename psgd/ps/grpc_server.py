"""The gRPC face of one shard: service `psgd.v1.ParameterShard` (protos/) over a `Shard`.

A thin adapter in the route_guide manner: each RPC reads its messages, calls the transport-free
core (psgd/ps/shard.py), which holds every check and state change, and writes the reply. A
`ShardError` becomes the RPC's status, with the core's code and one-line message.

- `Init`: header + chunks of the initial values (always fp32).
- `Push`: header + chunks of one gradient, received chunk by chunk into one of the shard's
  reused fp32 buffers straight from gRPC's bytes (`codec.data_view`: no protobuf copy); a sparse
  push (--topk: the header's `sparse_count`) sends SparseChunks instead, checked and scattered
  into that buffer (psgd/core/sparsify.py `Scatter`). Between the header and the data the push
  waits for its turn (`Shard.turn`: sync folds a step in worker order), its bytes left to gRPC's
  flow control, under the same deadline as a pull; the reply's `wait_s` says how long.
- `Pull`: held by the policy, then header + ~1 MiB frames of the snapshot in the wire dtype,
  built one at a time outside the lock (`codec.frames`) and sent as they are.
- `PushPull`: a Push, answered by the Pull of the next clock (one round trip per step): the
  pull's stream, its header carrying the push's outcome. One call carries a worker's whole run:
  push after push on the request stream (each header + exactly its announced data), pull after
  pull on the reply stream, until the worker closes its side; the pull's hold is bounded by the
  shard's `rpc_timeout` (the call itself has no deadline). A call per step works the same.
- `Leave`: a worker has finished (the last of N ends the shard's run: `Shard.finished`).
- `Join`: a worker takes a slot in the running job (`Shard.join`; psgd worker --join).
- `Info`: the shard's place and state, and the port of its TCP data plane (psgd/ps/tcp_server.py).
"""

from __future__ import annotations

import contextlib
import math

import grpc
import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec, link, sparsify
from psgd.core.errors import Code, ShardError
from psgd.ps import wire
from psgd.ps.shard import Shard


@contextlib.contextmanager
def aborts(context: grpc.ServicerContext):
    """Turn a ShardError into the RPC's status: the client sees the code and the message."""
    try:
        yield
    except ShardError as e:
        context.abort(grpc.StatusCode[e.code.name], e.message)


class ShardServicer:
    """The seven RPCs of one shard; all state is the Shard's (and guarded by its lock)."""

    def __init__(self, shard: Shard, data_port: int = 0) -> None:
        self.shard = shard
        self.data_port = data_port  # told to workers by Info (0: no TCP data plane)

    def Init(self, request_iterator, context):
        with aborts(context):
            h = _header(request_iterator)
            self.shard.check_init(h.worker_id, h.shard, h.num_elements)
            data = _receive(h, link.paced(request_iterator, self.shard.link_in, _chunk_len), wire.dtype_name(h.dtype))
            _expect_end(request_iterator)
            version, first = self.shard.init(data)
            return pb.InitReply(version=version, initialized_by_caller=first)

    def Push(self, request_iterator, context):
        with aborts(context):
            _, o, waited = self._received_push(_header(request_iterator), request_iterator, self._timeout(context),
                                               alone=True)
            return wire.push_reply(o, waited)

    def _timeout(self, context) -> float:
        """How long a push or pull of this call may be held: the shard's --rpc-timeout, or the call's
        deadline when sooner (a run-long PushPull has none: time_remaining None or "infinite")."""
        remaining = context.time_remaining()
        return min(math.inf if remaining is None else remaining, self.shard.options.rpc_timeout)

    def _received_push(self, h: pb.TensorHeader, request_iterator, timeout: float, alone: bool = False):
        """Read a push's data (its header `h` checked, and its turn waited for, before any) and hand
        it to the shard's policy; the receive buffer goes back to the pool before anything may wait.
        (header, PushOutcome, seconds it waited for its turn). `alone`: the stream's only message
        (Push): nothing may follow its data. While a push waits for its turn, gRPC's flow control
        keeps its bytes in the worker."""
        dtype = wire.dtype_name(h.dtype)
        self.shard.check_push(h.worker_id, h.shard, h.num_elements, h.sparse_count)
        waited = self.shard.turn(h.worker_id, h.clock, timeout)
        with self.shard.receive_buffer() as buf:
            chunks = link.paced(request_iterator, self.shard.link_in, _chunk_len)
            if h.sparse_count:
                grad, nbytes = _receive_sparse(h, chunks, dtype, buf), sparsify.wire_bytes(h.sparse_count, dtype)
            else:
                grad, nbytes = _receive(h, chunks, dtype, buf), None
            if alone:
                _expect_end(request_iterator)
            return h, self.shard.push(h.worker_id, h.clock, h.base_version, grad, dtype, nbytes), waited

    def Pull(self, request, context):
        with contextlib.ExitStack() as stack:
            with aborts(context):
                dtype = wire.dtype_name(request.dtype)
                p = stack.enter_context(self.shard.pull(request.worker_id, request.shard, request.clock, dtype,
                                                        context.time_remaining()))
            yield from self._pulled(p, request.dtype)

    def _pulled(self, p, dtype_enum: int, pushed: pb.PushReply | None = None):
        """A pull's reply stream: the header (with a PushPull's push outcome), then the values."""
        n = 0 if p.values is None else p.values.numel()
        yield pb.PullChunk(header=pb.PullHeader(version=p.version, num_elements=n, dtype=dtype_enum, done=p.done,
                                                wait_s=p.wait_s, clock_gap=p.clock_gap, pushed=pushed))
        if p.values is not None:
            # Framing outside the lock, one chunk at a time, overlaps the copy with sending and
            # lets malloc reuse one frame's memory for the next (measured: ~30% less server CPU
            # than framing all chunks under the lock).
            yield from link.paced(codec.frames(codec.encode(p.values, wire.dtype_name(dtype_enum))),
                                  self.shard.link_out)

    def PushPull(self, request_iterator, context):
        while True:
            with contextlib.ExitStack() as stack:
                with aborts(context):
                    h = _header(request_iterator, end_ok=True)
                    if h is None:
                        return  # the worker closed its side: its run is over
                    h, o, waited = self._received_push(h, request_iterator, self._timeout(context))
                    p = stack.enter_context(self.shard.next_pull(o, h.worker_id, h.shard, h.clock,
                                                                 wire.dtype_name(h.dtype), self._timeout(context)))
                yield from self._pulled(p, h.dtype, pushed=wire.push_reply(o, waited))

    def Leave(self, request, context):
        with aborts(context):
            return pb.LeaveReply(workers_left=self.shard.leave(request.worker_id, request.shard))

    def Join(self, request, context):
        with aborts(context):
            if request.cancel:
                self.shard.cancel_join(request.worker_id)
                return pb.JoinReply(worker_id=request.worker_id, version=self.shard.policy.version)
            worker, clock, version = self.shard.join(
                None if request.any_slot else request.worker_id, request.clock if request.has_clock else None,
                request.num_elements)
            return pb.JoinReply(worker_id=worker, clock=clock, version=version)

    def Info(self, request, context):
        s = self.shard
        return pb.InfoReply(shard=s.index, num_shards=s.options.num_shards, num_workers=s.workers,
                            mode=s.options.mode, version=s.policy.version, initialized=s.ready.is_set(),
                            num_elements=s.num_elements, data_port=self.data_port, clocks=s.policy.clocks)


def _header(request_iterator, end_ok: bool = False) -> pb.TensorHeader | None:
    """A message's header: the next item of the stream (`end_ok`: None at the stream's end)."""
    first = next(request_iterator, None)
    if first is None and end_ok:
        return None
    if first is None or isinstance(first, memoryview) or first.WhichOneof("kind") != "header":
        raise ShardError(Code.INVALID_ARGUMENT, "each message must start with a header")
    return first.header


def _expect_end(request_iterator) -> None:
    """A one-message stream (Init, Push) ends after its announced data."""
    if next(request_iterator, None) is not None:
        raise ShardError(Code.INVALID_ARGUMENT, "tensor data too long: more chunks than the header announced")


def _chunk_len(msg) -> int:
    if isinstance(msg, memoryview):
        return len(msg)
    return len(msg.sparse.indices) + len(msg.sparse.values) if msg.WhichOneof("kind") == "sparse" else len(msg.data)


def _receive(h: pb.TensorHeader, chunks, dtype: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The data chunks after a header, assembled into `out` (or a new tensor)."""
    asm = codec.Assembler(h.num_elements, dtype, out=out)
    try:
        # Exactly the announced bytes: on a PushPull stream the next push's header follows.
        while asm.received < asm.expected and (msg := next(chunks, None)) is not None:
            if isinstance(msg, memoryview):  # a data frame, parsed without a copy
                asm.add(msg)
            elif msg.WhichOneof("kind") == "data":
                asm.add(msg.data)
            else:
                raise ValueError(f"a {msg.WhichOneof('kind')} chunk inside a dense stream")
        return asm.finish()
    except ValueError as e:
        raise ShardError(Code.INVALID_ARGUMENT, str(e)) from None


def _receive_sparse(h: pb.TensorHeader, chunks, dtype: str, out: torch.Tensor) -> torch.Tensor:
    """The sparse chunks after a header with `sparse_count`, scattered into `out` (zeroed first)."""
    try:
        scatter = sparsify.Scatter(h.num_elements, h.sparse_count, dtype, out)
        while scatter.received < scatter.entries and (msg := next(chunks, None)) is not None:
            if isinstance(msg, memoryview) or msg.WhichOneof("kind") != "sparse":
                raise ValueError("a sparse push (header sparse_count > 0) carries sparse chunks only")
            scatter.add(msg.sparse.indices, msg.sparse.values)
        return scatter.finish()
    except ValueError as e:
        raise ShardError(Code.INVALID_ARGUMENT, str(e)) from None


def rpc_handlers(servicer: ShardServicer) -> grpc.GenericRpcHandler:
    """The ParameterShard service with frame-aware (de)serialisers for the tensor streams."""
    chunk = wire.frame_parser(pb.TensorChunk)
    methods = {
        "Init": grpc.stream_unary_rpc_method_handler(servicer.Init, chunk, pb.InitReply.SerializeToString),
        "Push": grpc.stream_unary_rpc_method_handler(servicer.Push, chunk, pb.PushReply.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull, pb.PullRequest.FromString, wire.serialize_frame),
        "PushPull": grpc.stream_stream_rpc_method_handler(servicer.PushPull, chunk, wire.serialize_frame),
        "Leave": grpc.unary_unary_rpc_method_handler(servicer.Leave, pb.LeaveRequest.FromString,
                                                     pb.LeaveReply.SerializeToString),
        "Info": grpc.unary_unary_rpc_method_handler(servicer.Info, pb.InfoRequest.FromString,
                                                    pb.InfoReply.SerializeToString),
        "Join": grpc.unary_unary_rpc_method_handler(servicer.Join, pb.JoinRequest.FromString,
                                                    pb.JoinReply.SerializeToString),
    }
    return grpc.method_handlers_generic_handler(wire.SERVICE, methods)
