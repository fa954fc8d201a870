/* out[m, n] = sum_k x[m, k] * w[n, k] for a GGUF weight whose rows are ggml blocks (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K,
 * IQ4_NL, IQ4_XS), on the CPU: a decode step's few rows against weights that stay in their blocks. Each output
 * feature's row is decoded one block at a time into floats on the stack, and the block is used by every input row
 * before the next is decoded, so a step reads 4.5-8.5 bits per weight instead of a float copy's 32 and writes no
 * dequantized matrix (the torch path, kernels/gguf_torch.py, dequantizes chunks of rows into float temporaries and
 * calls F.linear on them). The blocks are decoded as kernels/gguf_torch.py decodes them (its DECODERS, the oracle in
 * tests/test_gguf_cpu.py); sums run in another order: results agree to float32 rounding. Parallel over output features
 * on the library's pool (kernels/native_pool.c); built into the native library by kernels/native_kernels.py. */
#include <stdint.h>
#include <string.h>

void pagedesk_pool_run(void (*run)(const void *args, long chunk), const void *args, long chunks, long threads);

enum { Q4_0 = 2, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, MAX_ROWS = 64 };

/* IQ4_NL / IQ4_XS: a 4-bit code indexes this non-linear table (llama.cpp's kvalues_iq4nl; kernels/gguf_torch.py's
 * IQ4_VALUES). */
static const float IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

typedef float v8 __attribute__((vector_size(32)));

/* A little-endian IEEE half at p, exactly, from its bits (no _Float16: GCC before 12 has none on x86, and a build
 * that fails loses the whole native library). */
static inline float f16(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | mantissa << 13;  /* inf, NaN */
    } else if (exponent) {
        bits = sign | (exponent + 112) << 23 | mantissa << 13;  /* normal: 2^(e - 15) as 2^(e + 112 - 127) */
    } else {
        float f = (float)mantissa * 5.9604644775390625e-08f;  /* zero or subnormal: mantissa * 2^-24 */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The decoders are plain loops over runs of values that share a scale: the compiler vectorizes them (byte ->
 * float conversions in SIMD registers); an 8-byte vector type converted by __builtin_convertvector came out as
 * scalar code, 2x slower. */

/* Q8_0: 34 bytes, a float16 scale then 32 int8 codes. */
static void decode_q8_0(const uint8_t *b, float *out) {
    float d = f16(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) out[j] = (float)q[j] * d;
}

/* Q4_0: 18 bytes, a float16 scale then 16 bytes of nibbles: the low nibbles are values 0-15, the high ones 16-31,
 * each (nibble - 8) times the scale. */
static void decode_q4_0(const uint8_t *b, float *out) {
    float d = f16(b);
    const uint8_t *q = b + 2;
    for (int j = 0; j < 16; j++) out[j] = d * (float)((q[j] & 0x0F) - 8);
    for (int j = 0; j < 16; j++) out[16 + j] = d * (float)((q[j] >> 4) - 8);
}

/* IQ4_NL: Q4_0's layout, each nibble a table entry times the scale. */
static void decode_iq4_nl(const uint8_t *b, float *out) {
    float d = f16(b);
    const uint8_t *q = b + 2;
    for (int j = 0; j < 16; j++) out[j] = d * IQ4_VALUES[q[j] & 0x0F];
    for (int j = 0; j < 16; j++) out[16 + j] = d * IQ4_VALUES[q[j] >> 4];
}

/* IQ4_XS: 136 bytes for 256 values: d (float16), 16 bits of scales' high bits (two per sub-block), 4 bytes of their
 * low nibbles (sub-block 2j: byte j's low nibble, 2j + 1: its high one), 128 bytes of codes: sub-block s is IQ4_NL's
 * 16 bytes at 16 s under d * (6-bit scale - 32). */
static void decode_iq4_xs(const uint8_t *b, float *out) {
    float d = f16(b);
    int high_bits = b[2] | (b[3] << 8);
    for (int s = 0; s < 8; s++) {
        int low = s % 2 ? b[4 + s / 2] >> 4 : b[4 + s / 2] & 0x0F;
        float dl = d * (float)((low | (((high_bits >> (2 * s)) & 0x03) << 4)) - 32);
        const uint8_t *q = b + 8 + 16 * s;
        for (int j = 0; j < 16; j++) out[32 * s + j] = dl * IQ4_VALUES[q[j] & 0x0F];
        for (int j = 0; j < 16; j++) out[32 * s + 16 + j] = dl * IQ4_VALUES[q[j] >> 4];
    }
}

/* The eight 6-bit scales and mins of a Q4_K / Q5_K super-block (12 bytes), times d and dmin. */
static void k_scales(const uint8_t *s, float d, float dmin, float *scale, float *shift) {
    for (int i = 0; i < 8; i++) {
        int sc = i < 4 ? s[i] & 0x3F : (s[8 + i - 4] & 0x0F) | ((s[i - 4] >> 2) & 0x30);
        int mn = i < 4 ? s[4 + i] & 0x3F : (s[8 + i - 4] >> 4) | ((s[4 + i - 4] >> 2) & 0x30);
        scale[i] = d * (float)sc, shift[i] = dmin * (float)mn;
    }
}

/* Q4_K: 144 bytes for 256 values: d, dmin (float16), twelve bytes of eight 6-bit scales and mins, 128 bytes of
 * nibbles; sub-block 2i is the low nibbles of bytes 32i..32i+31, sub-block 2i+1 their high nibbles. */
static void decode_q4_k(const uint8_t *b, float *out) {
    float scale[8], shift[8];
    const uint8_t *qs = b + 16;
    k_scales(b + 4, f16(b), f16(b + 2), scale, shift);
    for (int p = 0; p < 4; p++) {  /* constant shifts: a variable one kept the loop scalar */
        const uint8_t *q = qs + p * 32;
        float *lo = out + 64 * p, *hi = lo + 32;
        for (int j = 0; j < 32; j++) lo[j] = scale[2 * p] * (float)(q[j] & 0x0F) - shift[2 * p];
        for (int j = 0; j < 32; j++) hi[j] = scale[2 * p + 1] * (float)(q[j] >> 4) - shift[2 * p + 1];
    }
}

/* Q5_K: 176 bytes for 256 values: Q4_K's d, dmin and scales, 32 bytes of fifth bits (sub-block s takes bit s of each
 * byte), then Q4_K's 128 bytes of nibbles. The bit is tested with a mask, not shifted out (a variable shift of
 * bytes kept the loop scalar). */
static void decode_q5_k(const uint8_t *b, float *out) {
    float scale[8], shift[8];
    const uint8_t *qh = b + 16, *qs = b + 48;
    k_scales(b + 4, f16(b), f16(b + 2), scale, shift);
    for (int p = 0; p < 4; p++) {
        const uint8_t *q = qs + p * 32;
        float *lo = out + 64 * p, *hi = lo + 32;
        int lo_bit = 1 << (2 * p), hi_bit = 2 << (2 * p);
        for (int j = 0; j < 32; j++)
            lo[j] = scale[2 * p] * (float)((q[j] & 0x0F) | (qh[j] & lo_bit ? 16 : 0)) - shift[2 * p];
        for (int j = 0; j < 32; j++)
            hi[j] = scale[2 * p + 1] * (float)((q[j] >> 4) | (qh[j] & hi_bit ? 16 : 0)) - shift[2 * p + 1];
    }
}

/* Q6_K: 210 bytes for 256 values: 128 bytes of low nibbles (two runs of 64 bytes: 64 low nibbles, then 64 high),
 * 64 bytes of 2-bit highs (two halves of 32 bytes, four 2-bit fields each), sixteen int8 scales, d (float16);
 * value t is d * scale[t / 16] * (6-bit code - 32). Half h (128 values) is four sub-blocks of 32: sub-block i takes
 * the low nibbles of ql's run h at offset 32 (i % 2) for i < 2, the high ones for i >= 2, and bits 2i..2i+1 of
 * qh's half h; each sub-block is spelled out (constant shifts: a variable one kept the loop scalar). */
static void decode_q6_k(const uint8_t *b, float *out) {
    const int8_t *scales = (const int8_t *)(b + 192);
    float d = f16(b + 208);
    for (int h = 0; h < 2; h++) {
        const uint8_t *lq = b + 64 * h, *hq = b + 128 + 32 * h;
        const int8_t *sc = scales + 8 * h;
        float *o = out + 128 * h;
        for (int half = 0; half < 2; half++) {
            float s0 = d * (float)sc[half], s1 = d * (float)sc[2 + half], s2 = d * (float)sc[4 + half],
                  s3 = d * (float)sc[6 + half];
            for (int j = 16 * half; j < 16 * half + 16; j++) {
                o[j] = s0 * (float)(((lq[j] & 0x0F) | ((hq[j] & 0x03) << 4)) - 32);
                o[32 + j] = s1 * (float)(((lq[32 + j] & 0x0F) | (((hq[j] >> 2) & 0x03) << 4)) - 32);
                o[64 + j] = s2 * (float)(((lq[j] >> 4) | (((hq[j] >> 4) & 0x03) << 4)) - 32);
                o[96 + j] = s3 * (float)(((lq[32 + j] >> 4) | (((hq[j] >> 6) & 0x03) << 4)) - 32);
            }
        }
    }
}

typedef struct {
    int type;
    const float *x;
    long M, K;
    const uint8_t *w;
    long row_bytes, N, chunk_rows;
    float *out;
    long out_stride;
} gguf_job;

static void gguf_chunk(const void *args, long chunk) {
    const gguf_job *j = args;
    int values = j->type == Q8_0 || j->type == Q4_0 || j->type == IQ4_NL ? 32 : 256;
    int bytes = j->type == Q4_0 || j->type == IQ4_NL ? 18 : j->type == Q8_0 ? 34 : j->type == Q4_K ? 144
              : j->type == Q5_K ? 176 : j->type == IQ4_XS ? 136 : 210;
    long n0 = chunk * j->chunk_rows, n1 = n0 + j->chunk_rows < j->N ? n0 + j->chunk_rows : j->N;
    float block[256];
    v8 acc[MAX_ROWS][4];  /* four independent sums per row: one would wait on each multiply-add's latency */
    for (long n = n0; n < n1; n++) {
        const uint8_t *row = j->w + (size_t)n * j->row_bytes;
        for (long m = 0; m < j->M; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = (v8){0};
        for (long k = 0; k < j->K; k += values, row += bytes) {
            switch (j->type) {
                case Q4_0: decode_q4_0(row, block); break;
                case Q8_0: decode_q8_0(row, block); break;
                case Q4_K: decode_q4_k(row, block); break;
                case Q5_K: decode_q5_k(row, block); break;
                case IQ4_NL: decode_iq4_nl(row, block); break;
                case IQ4_XS: decode_iq4_xs(row, block); break;
                default: decode_q6_k(row, block);
            }
            for (long m = 0; m < j->M; m++) {  /* the block against every row: decoded once, read M times */
                const float *xm = j->x + (size_t)m * j->K + k;
                v8 a0 = acc[m][0], a1 = acc[m][1], a2 = acc[m][2], a3 = acc[m][3];
                for (int t = 0; t < values; t += 32) {
                    a0 += load8(block + t) * load8(xm + t);
                    a1 += load8(block + t + 8) * load8(xm + t + 8);
                    a2 += load8(block + t + 16) * load8(xm + t + 16);
                    a3 += load8(block + t + 24) * load8(xm + t + 24);
                }
                acc[m][0] = a0, acc[m][1] = a1, acc[m][2] = a2, acc[m][3] = a3;
            }
        }
        for (long m = 0; m < j->M; m++) {
            v8 a = (acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3]);
            j->out[(size_t)m * j->out_stride + n] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        }
    }
}

/* type: a ggml type id (2 Q4_0, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K, 20 IQ4_NL, 23 IQ4_XS); x [M, K] float32, M <= 64; w
 * [N, row_bytes]; out [M, N] with rows out_stride floats apart (a run of a wider linear's output features). The caller
 * checks the type, M and that K is whole blocks. */
void pagedesk_gguf_gemm(long type, const float *x, long M, long K, const uint8_t *w, long row_bytes, long N,
                        float *out, long out_stride, long chunks_per_thread, long threads) {
    long chunk_rows = (N + chunks_per_thread * threads - 1) / (chunks_per_thread * threads);
    gguf_job job = {(int)type, x, M, K, w, row_bytes, N, chunk_rows < 1 ? 1 : chunk_rows, out, out_stride};
    pagedesk_pool_run(gguf_chunk, &job, (N + job.chunk_rows - 1) / job.chunk_rows, threads);
}
