"""Flat fp32 tensor <-> a stream of raw little-endian byte chunks, in a chosen wire dtype.

Contract:
- `encode(flat, dtype)` returns the tensor's bytes in the wire dtype (fp32, fp16 or bf16);
  `iter_chunks(buf)` cuts them into chunks of at most `CHUNK_BYTES` (1 MiB, a multiple of every
  element size); `frames(buf)` cuts them the same way into ready-serialised `{data: chunk}`
  messages (`TensorChunk` and `PullChunk` share that encoding), one copy each, which gRPC sends
  as they are; `data_view(message)` gives the payload of such a message back without a copy
  (None for any other message). `Assembler` writes received chunks straight into a destination
  fp32 tensor (given, e.g. the model's own buffer, or new) and `finish()` returns it. Decoding is
  exact for fp32 and equals `x.to(dtype).to(float32)` for the half types: the server always
  accumulates in fp32.
- A wrong total length raises ValueError (the server maps it to INVALID_ARGUMENT); the server
  assembles into a scratch buffer, so no state is touched.

Why raw bytes in ~1 MiB chunks: one 64 MiB protobuf message moves several times slower than the
same bytes streamed in 1 MiB chunks, most of it spent serialising (docs/architecture.md has the
figures). `repeated float` would be slower still. Why hand-built frames: building
a protobuf message copies the payload into it and serialising copies it again; the frame is the
same bytes on the wire with one copy (tensor -> bytes), and on receipt protobuf would copy the
payload out once more, where `data_view` copies nothing. Pure module: no gRPC here.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator

import numpy as np
import torch

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = CHUNK_BYTES + (1 << 16)  # a data frame plus its tag and length, with room
# The largest tensor a shard allocates for a header whose length it cannot check against its own
# config (a server started without the model's parameter count): 16 GiB, 4G fp32 elements.
MAX_TENSOR_BYTES = 1 << 34

# Name on the command line -> torch dtype on the wire.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}

_ITEMSIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in WIRE_DTYPES.values()}

assert sys.byteorder == "little", "psgd's wire format is little-endian; big-endian hosts are unsupported"


def itemsize(dtype: str) -> int:
    """Bytes per element of a wire dtype."""
    return _ITEMSIZE[_torch_dtype(dtype)]


def _torch_dtype(dtype: str) -> torch.dtype:
    try:
        return WIRE_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown wire dtype {dtype!r}; choose one of {sorted(WIRE_DTYPES)}") from None


def encode(flat: torch.Tensor, dtype: str) -> memoryview:
    """The bytes of a 1-D float tensor in the wire dtype, as a read-only memoryview.

    For fp32 on CPU this is a view of the tensor's own memory (no copy): the caller must not
    modify the tensor until the bytes are sent.
    """
    assert flat.dim() == 1, f"encode expects a flat tensor, got shape {tuple(flat.shape)}"
    wire = flat.detach().to(device="cpu", dtype=_torch_dtype(dtype)).contiguous()
    # numpy has no bfloat16, so reinterpret 2-byte types as int16 before taking the buffer.
    if wire.element_size() == 2:
        wire = wire.view(torch.int16)
    return memoryview(wire.numpy()).cast("B").toreadonly()


def iter_chunks(buf: memoryview, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Cut a buffer into consecutive chunks of at most chunk_bytes (none for an empty buffer)."""
    assert chunk_bytes > 0
    for start in range(0, len(buf), chunk_bytes):
        yield bytes(buf[start:start + chunk_bytes])


# Protobuf wire format of a message whose only field is `bytes data = 2` (TensorChunk and
# PullChunk both): tag (field 2 << 3 | wire type 2, length-delimited), varint length, payload.
_DATA_TAG = 0x12


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def frame(chunk: memoryview | bytes) -> bytes:
    """The serialised `{data: chunk}` message, built with exactly one copy of the payload."""
    return b"".join((bytes((_DATA_TAG,)), _varint(len(chunk)), chunk))


def frames(buf: memoryview, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """`iter_chunks`, but each chunk already serialised as a `{data: chunk}` message."""
    assert chunk_bytes > 0
    for start in range(0, len(buf), chunk_bytes):
        yield frame(buf[start:start + chunk_bytes])


def data_view(message: bytes) -> memoryview | None:
    """The payload of a serialised `{data: ...}` message as a view (no copy); None otherwise.

    Anything else (a header, an empty message, fields in another order) returns None and is
    left to the protobuf parser, so this shortcut never changes what a message means.
    """
    if len(message) < 2 or message[0] != _DATA_TAG:
        return None
    length, shift, pos = 0, 0, 1
    while pos < len(message) and pos <= 10:
        byte = message[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return memoryview(message)[pos:] if pos + length == len(message) else None
        shift += 7
    return None


class Assembler:
    """Writes the chunks of one tensor of known length, in order, into one fp32 tensor.

    `out` (1-D, fp32, CPU, contiguous, `num_elements` long) receives the values, e.g. the
    model's own parameter buffer or a reused scratch buffer; without it a new tensor is made.
    Each chunk is copied (and widened from fp16 / bf16) exactly once, straight to its place.
    """

    def __init__(self, num_elements: int, dtype: str, out: torch.Tensor | None = None) -> None:
        self.dtype = dtype
        self.num_elements = num_elements
        self.width = itemsize(dtype)
        self.expected = num_elements * self.width
        if out is None:
            out = torch.empty(num_elements, dtype=torch.float32)
        assert out.dtype == torch.float32 and out.is_contiguous() and out.device.type == "cpu", \
            "Assembler writes into a contiguous fp32 CPU tensor"
        assert out.numel() == num_elements, f"out has {out.numel()} elements, expected {num_elements}"
        self.out = out
        self._values = out.numpy()
        self._carry = b""  # a half-type element split across two chunks (never for our senders)
        self._widened = 0  # elements written so far (half types)
        self.received = 0

    def add(self, chunk: bytes | memoryview) -> None:
        end = self.received + len(chunk)
        if end > self.expected:
            raise ValueError(f"tensor data too long: got more than the {self.expected} bytes announced")
        if self.width == 4:
            self._values.view(np.uint8)[self.received:end] = np.frombuffer(chunk, np.uint8)
        else:
            if self._carry or len(chunk) % 2:
                joined = self._carry + bytes(chunk)
                cut = len(joined) - len(joined) % 2
                chunk, self._carry = joined[:cut], joined[cut:]
            self._widen(chunk, self._widened)
            self._widened += len(chunk) // 2
        self.received = end

    @property
    def elements(self) -> int:
        """Elements of `out` written so far (complete ones), for readers that overlap with receipt."""
        return self.received // 4 if self.width == 4 else self._widened

    def _widen(self, chunk: bytes | memoryview, first: int) -> None:
        count = len(chunk) // 2
        if self.dtype == "fp16":
            self._values[first:first + count] = np.frombuffer(chunk, "<f2")
        else:
            # bfloat16 is the top half of a float32's bits (numpy has no bf16): shifting the
            # 16-bit patterns into the high half is the exact widening torch does.
            bits = self._values.view(np.uint32)[first:first + count]
            bits[...] = np.frombuffer(chunk, "<u2")
            bits <<= 16

    def finish(self) -> torch.Tensor:
        """The fp32 tensor; raises ValueError when fewer bytes arrived than announced."""
        if self.received != self.expected:
            raise ValueError(f"tensor data too short: got {self.received} of {self.expected} bytes")
        return self.out


def decode(data: bytes | bytearray | memoryview, dtype: str) -> torch.Tensor:
    """Wire bytes -> a new fp32 tensor (the buffer is not shared with the result)."""
    width = itemsize(dtype)
    if len(data) % width:
        raise ValueError(f"{len(data)} bytes is not a whole number of {dtype} elements")
    asm = Assembler(len(data) // width, dtype)
    asm.add(data)
    return asm.finish()


def sha256(values: torch.Tensor) -> str:
    """SHA-256 of a tensor's fp32 bytes: summary.json's `params_sha256`, and the all-reduce
    replicas' consistency check (every copy must hash the same)."""
    return hashlib.sha256(values.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()
