import pytest
import torch

from psgd.core import codec


@pytest.mark.parametrize("dtype", sorted(codec.WIRE_DTYPES))
def test_round_trip_edge_sizes(dtype):
    per_chunk = codec.CHUNK_BYTES // codec.itemsize(dtype)
    for n in (0, 1, per_chunk - 1, per_chunk, per_chunk + 1):
        x = torch.randn(n)
        chunks = list(codec.iter_chunks(codec.encode(x, dtype)))
        assert all(len(c) <= codec.CHUNK_BYTES for c in chunks)
        assert len(chunks) == -(-n * codec.itemsize(dtype) // codec.CHUNK_BYTES)
        asm = codec.Assembler(n, dtype)
        for c in chunks:
            asm.add(c)
        y = asm.finish()
        assert y.dtype == torch.float32 and y.shape == (n,)
        assert torch.equal(y, x.to(codec.WIRE_DTYPES[dtype]).to(torch.float32))


@pytest.mark.parametrize("dtype", sorted(codec.WIRE_DTYPES))
def test_round_trip_100mb(dtype):
    n = 100 * 2**20 // 4
    x = torch.linspace(-3, 3, n)
    asm = codec.Assembler(n, dtype)
    for c in codec.iter_chunks(codec.encode(x, dtype)):
        asm.add(c)
    assert torch.equal(asm.finish(), x.to(codec.WIRE_DTYPES[dtype]).float())


def test_fp32_is_exact_and_half_types_halve_bytes():
    x = torch.randn(1000)
    assert len(codec.encode(x, "fp32")) == 4000
    assert len(codec.encode(x, "fp16")) == len(codec.encode(x, "bf16")) == 2000
    assert torch.equal(codec.decode(codec.encode(x, "fp32"), "fp32"), x)


def test_wrong_length_is_refused():
    asm = codec.Assembler(3, "fp32")
    with pytest.raises(ValueError, match="too long"):
        asm.add(b"\0" * 16)
    asm = codec.Assembler(3, "fp32")
    asm.add(b"\0" * 8)
    with pytest.raises(ValueError, match="too short"):
        asm.finish()
    with pytest.raises(ValueError, match="whole number"):
        codec.decode(b"\0" * 3, "fp16")
    with pytest.raises(ValueError, match="unknown wire dtype"):
        codec.itemsize("fp8")
