"""What both ends of the parameter-server wire share: dtype enums, the service, framing hooks.

- `DTYPE_NAMES` / `DTYPE_ENUMS`: the .proto's WireDType <-> the codec's names (fp32, fp16, bf16).
- `SERVICE`, `CHANNEL_OPTIONS`: the gRPC service name and the message-size options both ends
  need (gRPC's default cap is 4 MiB per message; one data frame is up to codec.MAX_MESSAGE_BYTES).
- The (de)serialisers of the tensor streams: data frames built by `codec.frames` go out as they
  are, and come in as zero-copy memoryviews (`codec.data_view`); every other message is parsed
  by protobuf. The bytes on the wire are exactly the protobuf messages of the .proto.
- `push_reply(outcome, wait_s)`: a push's outcome (and its wait for its turn) as the .proto's PushReply.
- `parse_header`, `scatter_sparse`: a raw-TCP frame's header and a sparse push's payload, read
  with ShardError(INVALID_ARGUMENT) for bytes that do not parse (psgd/ps/tcp_server.py).
- `reuse_freed_memory()`: a process-wide allocator setting both ends make (see its docstring).
"""

from __future__ import annotations

import ctypes

from google.protobuf.message import DecodeError

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec, sparsify
from psgd.core.errors import Code, ShardError

DTYPE_NAMES = {pb.FP32: "fp32", pb.FP16: "fp16", pb.BF16: "bf16"}
DTYPE_ENUMS = {v: k for k, v in DTYPE_NAMES.items()}
SERVICE = pb.DESCRIPTOR.services_by_name["ParameterShard"].full_name
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES)]
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>


def push_reply(outcome, wait_s: float = 0.0) -> pb.PushReply:
    """A policy's PushOutcome (psgd/core/consistency.py) as the .proto's PushReply (both transports);
    `wait_s`: the seconds the push waited for its turn (`Shard.turn`)."""
    return pb.PushReply(version=outcome.version, applied=outcome.applied, skipped=outcome.skipped,
                        done=outcome.done, staleness=outcome.staleness, refused=outcome.refused, wait_s=wait_s)


def serialize_frame(message) -> bytes:
    """Serialiser of a tensor stream (Push / Init requests, Pull replies): frames as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def frame_parser(message_type):
    """Deserialiser of a tensor stream: a data frame as a zero-copy view, anything else parsed."""
    def parse(data: bytes):
        view = codec.data_view(data)
        return view if view is not None else message_type.FromString(data)
    return parse


def reuse_freed_memory() -> None:
    """Ask glibc to keep freed multi-MiB blocks for reuse instead of returning them to the OS.

    Every chunk gRPC hands us (and every frame we build) is a fresh 1 MiB `bytes`; by default
    glibc serves blocks that size with mmap and unmaps them on free, so each one page-faults
    afresh. Raising the mmap threshold to its maximum (32 MiB) and the trim threshold keeps them
    in the heap, and a large pull costs the client less CPU (docs/architecture.md). Process-wide
    and idempotent; a no-op where libc has no mallopt (not glibc).
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


def dtype_name(enum: int) -> str:
    """The codec's name of a WireDType; ShardError(INVALID_ARGUMENT) for an unknown one."""
    name = DTYPE_NAMES.get(enum)
    if name is None:
        raise ShardError(Code.INVALID_ARGUMENT, f"unknown wire dtype {enum}")
    return name


def parse_header(message_type, data: bytes):
    """A frame header's protobuf message; ShardError(INVALID_ARGUMENT) when it does not parse."""
    try:
        return message_type.FromString(data)
    except DecodeError:
        raise ShardError(Code.INVALID_ARGUMENT,
                         f"malformed {message_type.DESCRIPTOR.name} in a frame header") from None


def scatter_sparse(payload: bytearray, h: pb.TensorHeader, dtype: str, out) -> None:
    """A sparse push's payload (every index, then every value) checked and scattered into `out`."""
    cut = h.sparse_count * sparsify.INDEX_BYTES
    view = memoryview(payload)
    try:
        scatter = sparsify.Scatter(h.num_elements, h.sparse_count, dtype, out)
        scatter.add(view[:cut], view[cut:])
        scatter.finish()
    except ValueError as e:
        raise ShardError(Code.INVALID_ARGUMENT, str(e)) from None
