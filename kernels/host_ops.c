/* A decode step's small float32 ops on the CPU in one call each: the residual add fused into RMSNorm, SiLU(gate) or
 * GELU-tanh(gate) times up, and the rotary embedding of q and k in place. Torch runs each as several ops (RMSNorm: add,
 * pow, mean, add, rsqrt, mul, mul), microseconds of dispatch apiece at a few rows, more once the step's weights have
 * streamed through the cache. Compiled on the user's machine by kernels/native_build.py and called by
 * kernels/cpu_host_ops.py; the oracles are torch's ops (tests/test_cpu_host_ops.py): the same formulas in the same
 * order, the sums of squares in another order. */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* out = s * (1 / sqrt(mean(s^2) + eps)) * (weight + offset) per row, s = x + residual (residual may be NULL);
 * sum_out (may be NULL) gets s. Gemma's norm passes offset 1 (its weight is stored as w - 1). */
void pagedesk_rms_norm(const float *x, const float *residual, const float *weight, float offset, float eps,
                       long rows, long n, float *out, float *sum_out) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        const float *rr = residual ? residual + (size_t)r * n : NULL;
        float *sr = sum_out ? sum_out + (size_t)r * n : NULL;
        const float *src = sr ? sr : xr;
        v8 acc = (v8){0};
        long i = 0;
        for (; i + 8 <= n; i += 8) {
            v8 v = load8(xr + i);
            if (rr) v += load8(rr + i);
            if (sr) store8(sr + i, v);
            acc += v * v;
        }
        float squares = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; i < n; i++) {
            float v = rr ? xr[i] + rr[i] : xr[i];
            if (sr) sr[i] = v;
            squares += v * v;
        }
        float inv = 1.0f / sqrtf(squares / (float)n + eps);
        float *orow = out + (size_t)r * n;
        for (i = 0; i < n; i++) orow[i] = src[i] * inv * (weight[i] + offset);
    }
}

/* exp(x) on 8 floats from arithmetic alone (libm's expf is one value at a time: silu_mul took 4-5x torch's
 * vectorised time with it): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error
 * under 1e-7 there), times 2^n put into the exponent bits. x is clamped to [-87, 88], where 2^n stays a normal
 * float: exp(-87) is 1.6e-38, and silu, its one user, needs no less. GCC/Clang vector extensions. */
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 exp8(v8 x) {
    v8 lo = (v8){0} - 87.0f, hi = (v8){0} + 88.0f;
    v8i below = x < lo, above = x > hi;
    x = (v8)((below & (v8i)lo) | (~below & (v8i)x));
    x = (v8)((above & (v8i)hi) | (~above & (v8i)x));
    const float magic = 12582912.0f;  /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    v8 n = (x * 1.44269504088896341f + magic) - magic;
    v8 r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  /* ln2 in two parts */
    v8 p = (v8){0} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8)bits;
}

/* silu(g) = g / (1 + exp(-g)) */
static inline v8 silu8(v8 g) { return g / (1.0f + exp8(-g)); }

/* The tanh approximation of GELU (HF's gelu_pytorch_tanh, torch's approximate="tanh"): 0.5 g (1 + tanh(y)),
 * y = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + exp(-2y)), the same value without 1 + tanh's
 * cancellation where tanh(y) is near -1. Gemma's MLP. */
static inline v8 gelu_tanh8(v8 g) {
    v8 y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.0f + exp8(-2.0f * y));
}

/* out[r, i] = act(g) * u with g = gate_up[r, i], u = gate_up[r, width + i], 8 values at a time; act is a constant
 * after inlining. */
static inline __attribute__((always_inline)) void gated_mul(const float *gate_up, long rows, long width, float *out,
                                                            v8 (*act)(v8)) {
    for (long r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * width;
        const float *u = g + width;
        float *o = out + (size_t)r * width;
        long i = 0;
        for (; i + 8 <= width; i += 8) store8(o + i, act(load8(g + i)) * load8(u + i));
        if (i < width) {  /* the row's last few, through the same vectors padded with zeros */
            v8 gv = {0}, uv = {0};
            memcpy(&gv, g + i, (width - i) * sizeof(float));
            memcpy(&uv, u + i, (width - i) * sizeof(float));
            v8 ov = act(gv) * uv;
            memcpy(o + i, &ov, (width - i) * sizeof(float));
        }
    }
}

void pagedesk_silu_mul(const float *gate_up, long rows, long width, float *out) {
    gated_mul(gate_up, rows, width, out, silu8);
}

void pagedesk_gelu_tanh_mul(const float *gate_up, long rows, long width, float *out) {
    gated_mul(gate_up, rows, width, out, gelu_tanh8);
}

/* Rotate-half RoPE in place on `heads` heads of head_dim floats per row (q's heads then k's, side by side in the QKV
 * projection's output), the first rotary_dim of each: x * (cos, cos) + (x2, x1) * (-sin, sin), cos and sin laid out
 * so per row (engine/layers/rotary.py cos_sin_at). Each product rounded, then the sum, as torch's three ops: no
 * contraction into a fused multiply-add, so the result is torch's bit for bit. */
__attribute__((optimize("fp-contract=off"))) void pagedesk_rope(float *x, long rows, long row_stride, long heads,
                                                               long head_dim, long rotary_dim, const float *cos,
                                                               const float *sin) {
    long half = rotary_dim / 2;
    for (long r = 0; r < rows; r++) {
        const float *c = cos + (size_t)r * rotary_dim, *s = sin + (size_t)r * rotary_dim;
        for (long h = 0; h < heads; h++) {
            float *p = x + (size_t)r * row_stride + (size_t)h * head_dim;
            for (long i = 0; i < half; i++) {
                float a = p[i], b = p[i + half];
                float lo = a * c[i], lo_rolled = b * s[i];
                float hi = b * c[i + half], hi_rolled = a * s[i + half];
                p[i] = lo + lo_rolled;
                p[i + half] = hi + hi_rolled;
            }
        }
    }
}
