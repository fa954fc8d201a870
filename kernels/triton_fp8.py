"""FP8 <-> float32 by bit manipulation inside Triton kernels, so FP8 KV caches work on GPUs without FP8
instructions (Ampere sm_86): caches are passed as ``uint8`` views and these helpers turn bytes into
floats and back. Encoding saturates to the finite range and rounds to nearest even, byte-for-byte like
``torch.Tensor.to(float8)`` after clamping; NaN keeps its sign and becomes 0x7f. Decoding covers
subnormals, e5m2 infinities and NaNs. Never uses ``tl.float8*`` types or hardware conversions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class Fp8Format:
    code: int  # the FP8_FORMAT constexpr the kernels branch on; 0 means "not fp8"
    man_bits: int
    bias: int
    max: float


NOT_FP8 = 0
E4M3FN = 1
E5M2 = 2
FP8_FORMATS = {
    torch.float8_e4m3fn: Fp8Format(E4M3FN, man_bits=3, bias=7, max=448.0),
    torch.float8_e5m2: Fp8Format(E5M2, man_bits=2, bias=15, max=57344.0),
}


def fp8_format_code(dtype: torch.dtype) -> int:
    fmt = FP8_FORMATS.get(dtype)
    return NOT_FP8 if fmt is None else fmt.code


@triton.jit
def e4m3fn_to_float(byte):
    """uint8 e4m3fn bytes -> float32. No infinities; 0x7f/0xff are NaN; exponent 0 is subnormal (2^-9 units)."""
    b = byte.to(tl.int32)
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    magnitude = tl.where((b & 0x7F) == 0x7F, float("nan"), magnitude)
    return tl.where((b & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def e5m2_to_float(byte):
    """uint8 e5m2 bytes -> float32. e5m2 is the high byte of an IEEE fp16, so subnormals, inf and NaN carry over."""
    half_bits = byte.to(tl.uint16) << 8
    return half_bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def fp8_to_float(byte, FP8_FORMAT: tl.constexpr):
    if FP8_FORMAT == 1:
        return e4m3fn_to_float(byte)
    else:
        return e5m2_to_float(byte)


@triton.jit
def float_to_fp8(x, MAN_BITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr):
    """float32 -> uint8 fp8 bytes: saturate to +-FP8_MAX, round to nearest even (subnormals too), NaN -> 0x7f|sign.

    Works on the integer significand: the shift that drops the extra mantissa bits grows by one per
    exponent step below the smallest normal, which is what makes subnormals round correctly.
    """
    is_nan = x != x
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    clamped = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    magnitude_bits = clamped.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    exponent32 = magnitude_bits >> 23
    fraction = magnitude_bits & 0x7FFFFF
    significand = tl.where(exponent32 > 0, fraction | 0x800000, fraction)
    exponent = tl.maximum(exponent32, 1) - 127 + BIAS  # unbiased fp32 exponent, rebiased for fp8
    shift = tl.minimum((23 - MAN_BITS) + tl.maximum(1 - exponent, 0), 30)
    kept = significand >> shift
    dropped = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (dropped > half) | ((dropped == half) & ((kept & 1) == 1))
    code = kept + round_up.to(tl.int32) + ((tl.maximum(exponent, 1) - 1) << MAN_BITS)
    code = tl.where(is_nan, 0x7F, code) | sign
    return code.to(tl.uint8)
