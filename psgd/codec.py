"""Flat fp32 tensor <-> a stream of raw little-endian byte chunks, in a chosen wire dtype.

Contract:
- `encode(flat, dtype)` returns the tensor's bytes in the wire dtype (fp32, fp16 or bf16);
  `iter_chunks(buf)` cuts them into chunks of at most `CHUNK_BYTES` (1 MiB, a multiple of every
  element size) without copying; `Assembler` puts received chunks back into one preallocated
  buffer and `finish()` returns an fp32 tensor. Decoding is exact for fp32 and equals
  `x.to(dtype).to(float32)` for the half types: the server always accumulates in fp32.
- A wrong total length raises ValueError before any state is touched (the server maps it to
  INVALID_ARGUMENT).

Why raw bytes in ~1 MiB chunks: on the reference machine one 64 MiB protobuf message moved at
0.39 GB/s and took 169 ms just to serialise, while 1 MiB chunks streamed at 1.1 GB/s
(docs/architecture.md). `repeated float` would be slower still. Pure module: no gRPC here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

CHUNK_BYTES = 1 << 20

# Name on the command line -> torch dtype on the wire.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}

assert sys.byteorder == "little", "psgd's wire format is little-endian; big-endian hosts are unsupported"


def itemsize(dtype: str) -> int:
    """Bytes per element of a wire dtype."""
    return torch.empty((), dtype=_torch_dtype(dtype)).element_size()


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


class Assembler:
    """Collects the chunks of one tensor of known length into one preallocated buffer."""

    def __init__(self, num_elements: int, dtype: str) -> None:
        self.dtype = dtype
        self.num_elements = num_elements
        self.expected = num_elements * itemsize(dtype)
        self._buf = bytearray(self.expected)
        self.received = 0

    def add(self, chunk: bytes) -> None:
        end = self.received + len(chunk)
        if end > self.expected:
            raise ValueError(f"tensor data too long: got more than the {self.expected} bytes announced")
        self._buf[self.received:end] = chunk
        self.received = end

    def finish(self) -> torch.Tensor:
        """The fp32 tensor; raises ValueError when fewer bytes arrived than announced."""
        if self.received != self.expected:
            raise ValueError(f"tensor data too short: got {self.received} of {self.expected} bytes")
        return decode(self._buf, self.dtype)


def decode(data: bytes | bytearray | memoryview, dtype: str) -> torch.Tensor:
    """Wire bytes -> a new fp32 tensor (the buffer is not shared with the result)."""
    width = itemsize(dtype)
    if len(data) % width:
        raise ValueError(f"{len(data)} bytes is not a whole number of {dtype} elements")
    if len(data) == 0:
        return torch.empty(0, dtype=torch.float32)
    if not isinstance(data, bytearray):
        data = bytearray(data)  # torch.frombuffer wants a writable buffer
    raw_dtype = torch.int16 if width == 2 else torch.float32
    raw = torch.frombuffer(data, dtype=raw_dtype)
    if width == 2:
        raw = raw.view(_torch_dtype(dtype))
    # .to() copies for the half types; clone() makes fp32 independent of the buffer too.
    return raw.to(torch.float32) if width == 2 else raw.clone()
