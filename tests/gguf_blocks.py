"""GGUF block data for tests: random blocks of each format, and simple encoders for the formats the `gguf` library
cannot quantize (Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS).

`random_blocks` fills every byte at random but the float16 scales, which get finite random values (a NaN scale
would make a bit-for-bit comparison meaningless). The encoders are not llama.cpp's searches, only valid
encodings with a scale per sub-block chosen from the data, good enough for a tiny model to keep its greedy
continuations close to float; anything the `gguf` library quantizes itself (Q8_0, Q4_0, F16, BF16) goes
through `gguf.quants.quantize`, so the files tests write are what real tools write.
"""
from __future__ import annotations

import numpy as np

from kernels.gguf_torch import BLOCK_FORMATS, IQ4_VALUES

FORMAT_IDS = {f.name: f.ggml_type for f in BLOCK_FORMATS.values()}
QUANTIZED = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                 "Q6_K": (208,)}


def random_blocks(name: str, n_blocks: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """[n_blocks, type_size] uint8 of random content with finite float16 scales (normal, `scale` wide)."""
    fmt = BLOCK_FORMATS[FORMAT_IDS[name]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, fmt.type_size), dtype=np.uint8)
    if name == "MXFP4":  # E8M0 scale byte: 2^-17 .. 2^2 (float16 sums stay finite), the subnormal corner (0, 1) too
        blocks[:, 0] = rng.integers(110, 130, size=n_blocks, dtype=np.uint8)
        blocks[:2, 0] = (0, 1)
    for offset in SCALE_OFFSETS.get(name, ()):
        scales = (rng.standard_normal(n_blocks) * scale).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def quantize(data: np.ndarray, name: str) -> np.ndarray:
    """float32 [..., K] -> GGUF bytes [..., K / QK * type_size] in format `name`."""
    import gguf
    if name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "MXFP4"):
        return gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType[name])
    fmt = BLOCK_FORMATS[FORMAT_IDS[name]]
    rows = data.astype(np.float32).reshape(-1, fmt.block_size)
    encoded = ENCODERS[name](rows)
    assert encoded.shape == (rows.shape[0], fmt.type_size)
    return encoded.reshape(*data.shape[:-1], data.shape[-1] // fmt.block_size * fmt.type_size)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def _pack_nibbles(codes: np.ndarray, group: int) -> np.ndarray:
    """Inverse of the decoders' nibble order: in each run of 2 * group codes, the first group are low nibbles."""
    n = codes.shape[0]
    runs = codes.reshape(n, -1, 2, group).astype(np.uint8)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, -1)


def _k_scale_bytes(sc: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block -> Q4_K/Q5_K's 12 bytes."""
    sc, mins = sc.astype(np.uint8), mins.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mins[:, :4] & 0x3F) | ((mins[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return out


def _affine_k(rows: np.ndarray, levels: int):
    """Per 32-wide sub-block: value ~ d * sc * q - dmin * m with q in [0, levels]."""
    n = rows.shape[0]
    sub = rows.reshape(n, 8, 32)
    lo = np.maximum(0.0, -sub.min(axis=2))
    step = (sub.max(axis=2) + lo) / levels
    d = (step.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (lo.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    safe = lambda a: np.where(a == 0, 1, a)  # noqa: E731
    sc = np.clip(np.rint(step / safe(d)[:, None]), 0, 63)
    m = np.clip(np.rint(lo / safe(dmin)[:, None]), 0, 63)
    scale = (d[:, None] * sc)[:, :, None]
    offset = (dmin[:, None] * m)[:, :, None]
    q = np.clip(np.rint((sub + offset) / np.where(scale == 0, 1, scale)), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q.reshape(n, 256)


def _q4_k(rows: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(rows, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, m), _pack_nibbles(q, 32)], axis=1)


def _q5_k(rows: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_k(rows, 31)
    n = rows.shape[0]
    high = (q.reshape(n, 8, 32) >> 4) & 1
    qh = np.zeros((n, 32), dtype=np.uint8)
    for s in range(8):
        qh |= (high[:, s] << s).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, m), qh,
                           _pack_nibbles(q & 0x0F, 32)], axis=1)


def _q6_k(rows: np.ndarray) -> np.ndarray:
    n = rows.shape[0]
    sub = rows.reshape(n, 16, 16)
    step = np.abs(sub).max(axis=2) / 31
    d = (step.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(step / np.where(d == 0, 1, d)[:, None]), -128, 127)
    scale = (d[:, None] * sc)[:, :, None]
    q = (np.clip(np.rint(sub / np.where(scale == 0, 1, scale)), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    halves = q.reshape(n, 2, 4, 32)  # per half of 128: four sub-blocks of 32 (ql nibble / qh shift order)
    ql = np.concatenate([np.concatenate([(halves[:, h, 0] & 0xF) | ((halves[:, h, 2] & 0xF) << 4),
                                         (halves[:, h, 1] & 0xF) | ((halves[:, h, 3] & 0xF) << 4)], axis=1)
                         for h in range(2)], axis=1)
    qh = np.concatenate([sum(((halves[:, h, t] >> 4) & 3) << (2 * t) for t in range(4)).astype(np.uint8)
                         for h in range(2)], axis=1)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


def _nearest_iq4(x: np.ndarray) -> np.ndarray:
    table = np.array(IQ4_VALUES, dtype=np.float32)
    return np.abs(x[..., None] - table).argmin(axis=-1).astype(np.uint8)


def _iq4_nl(rows: np.ndarray) -> np.ndarray:
    d = (np.abs(rows).max(axis=1) / 127).astype(np.float16).astype(np.float32)
    q = _nearest_iq4(rows / np.where(d == 0, 1, d)[:, None])
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q, 16)], axis=1)


def _iq4_xs(rows: np.ndarray) -> np.ndarray:
    n = rows.shape[0]
    sub = rows.reshape(n, 8, 32)
    step = np.abs(sub).max(axis=2) / 127
    d = (step.max(axis=1) / 31).astype(np.float16).astype(np.float32)
    scales = np.clip(np.rint(step / np.where(d == 0, 1, d)[:, None]), -32, 31).astype(np.int32)
    dl = (d[:, None] * scales)[:, :, None]
    q = _nearest_iq4(sub / np.where(dl == 0, 1, dl)).reshape(n, 256)
    biased = (scales + 32).astype(np.uint16)
    low = (biased & 0xF).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    scales_h = sum(((biased[:, s] >> 4) & 3) << (2 * s) for s in range(8)).astype(np.uint16)
    return np.concatenate([_f16_bytes(d), scales_h.view(np.uint8).reshape(n, 2), scales_l,
                           _pack_nibbles(q, 16)], axis=1)


ENCODERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
