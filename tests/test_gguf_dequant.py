"""GGUF block formats: our torch dequantization equals the `gguf` library's reference bit for bit, per format.

Random blocks (every byte random but finite float16 scales) of each format the engine reads go through
kernels/gguf_torch.py and through `gguf.quants.dequantize`; the float32 results must be the same bits. The
test encoders (tests/gguf_blocks.py) for the formats `gguf` cannot quantize are checked to round-trip close.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_blocks import FORMAT_IDS, QUANTIZED, quantize, random_blocks

from kernels.gguf_torch import BLOCK_FORMATS, dequantize_gguf, row_bytes


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantization_is_bit_for_bit_the_reference(name):
    blocks = random_blocks(name, 64, seed=FORMAT_IDS[name])
    fmt = BLOCK_FORMATS[FORMAT_IDS[name]]
    rows = blocks.reshape(8, 8 * fmt.type_size)  # 8 rows of 8 blocks
    expected = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[name])
    got = dequantize_gguf(torch.from_numpy(rows), fmt.ggml_type)
    assert got.shape == expected.shape == (8, 8 * fmt.block_size)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(np.ascontiguousarray(expected)).view(torch.int32))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types_read_as_their_values(name):
    values = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    raw = quantize(values, name)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    got = dequantize_gguf(torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)).reshape(4, -1),
                          FORMAT_IDS[name])
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected)).reshape(4, 64))


@pytest.mark.parametrize("name", QUANTIZED)
def test_test_encoders_round_trip(name):
    values = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32)
    raw = quantize(values, name)
    assert raw.shape == (6, row_bytes(FORMAT_IDS[name], 512))
    decoded = dequantize_gguf(torch.from_numpy(raw), FORMAT_IDS[name]).numpy()
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    assert np.array_equal(decoded, reference)
    error = np.abs(decoded - values).mean() / np.abs(values).mean()
    assert error < {"Q8_0": 0.01, "Q6_K": 0.05, "Q5_K": 0.08}.get(name, 0.2), error


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="Q4_K rows of 100 bytes are not whole blocks of 144"):
        dequantize_gguf(torch.zeros(2, 100, dtype=torch.uint8), FORMAT_IDS["Q4_K"])
    with pytest.raises(ValueError, match="GGUF tensor type 10 has no decoder here; supported: F32"):
        dequantize_gguf(torch.zeros(2, 84, dtype=torch.uint8), 10)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_the_cpu_linear_in_chunks_of_rows_is_the_whole_matrix_product(name, monkeypatch):
    """gguf_linear_torch dequantizes CHUNK_WEIGHTS at a time (a cache's worth, not a whole matrix per call):
    the same product, bias added once, when the rows split unevenly too."""
    import kernels.gguf_torch as gguf_torch
    fmt = BLOCK_FORMATS[FORMAT_IDS[name]]
    w = torch.from_numpy(random_blocks(name, 37 * 2, seed=3)).reshape(37, -1)  # 37 rows of 2 blocks
    gen = torch.Generator().manual_seed(0)
    x, bias = torch.randn(3, 2 * fmt.block_size, generator=gen), torch.randn(37, generator=gen)
    whole = torch.nn.functional.linear(x, dequantize_gguf(w, fmt.ggml_type), bias)
    monkeypatch.setattr(gguf_torch, "CHUNK_WEIGHTS", 5 * x.shape[1])  # 5 rows at a time: 7 full chunks and 2 rows
    got = gguf_torch.gguf_linear_torch(x, w, fmt.ggml_type, bias)  # the bias is added apart: rounding may differ
    torch.testing.assert_close(got, whole, atol=1e-5 * whole.abs().max().item(), rtol=1e-5)
