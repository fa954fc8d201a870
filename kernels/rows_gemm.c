/* out[m, n] = sum_k x[m, k] * w[n, k] for the output features n in [n0, n1): a float32 GEMM for the few rows of a
 * decode step on the CPU, compiled on the user's machine by kernels/native_build.py (-O3 -march=native), and run in
 * parallel over output features on the library's thread pool (kernels/native_pool.c). x [M, K], w [N, K] (torch's
 * [out, in]) and out [M, N] are C-contiguous.
 *
 * Each tile multiplies NW weight rows by MR input rows with NW x MR vector accumulators (12 of the 16 AVX2
 * registers), so a loaded weight vector serves MR rows and a loaded input vector NW weight rows; the weight rows
 * PREFETCH_ROWS ahead are prefetched as the tile walks k (1 line per 8 floats; weights stream from memory once
 * per step, and the hardware prefetcher alone left the 2-core AMD machine's linears 20-30% slower, BENCHMARKS.md)
 * into every cache level (T0): a non-temporal prefetch, which on that machine did as well, made the 2-core Intel
 * Xeon's (480 MiB L3, which holds a small model whole) linears 4x slower: its lines skip the L3, so every pass read
 * the weights from memory again.
 * The sums run in another order than torch's BLAS: results agree to float32 rounding. GCC/Clang vector extensions,
 * no intrinsics: the same source builds for AVX2, AVX-512 (as 256-bit) and NEON. */
#include <stddef.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

enum { NW = 3, MR = 4, PREFETCH_ROWS = 4 };

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum8(v8 v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* nw weight rows from n by mr input rows from m; nw <= NW and mr <= MR are constants after inlining. */
static inline __attribute__((always_inline)) void tile(const float *x, long K, const float *w, long N, float *out,
                                                       long n, long m, int nw, int mr, const float *ahead) {
    v8 acc[NW][MR];
    for (int i = 0; i < nw; i++)
        for (int j = 0; j < mr; j++) acc[i][j] = (v8){0};
    long k = 0;
    for (; k + 8 <= K; k += 8) {
        v8 wv[NW];
        for (int i = 0; i < nw; i++) {
            if (ahead) __builtin_prefetch(ahead + (size_t)i * K + k, 0, 3);
            wv[i] = load8(w + (size_t)(n + i) * K + k);
        }
        for (int j = 0; j < mr; j++) {
            v8 xv = load8(x + (size_t)(m + j) * K + k);
            for (int i = 0; i < nw; i++) acc[i][j] += wv[i] * xv;
        }
    }
    for (int i = 0; i < nw; i++)
        for (int j = 0; j < mr; j++) {
            float s = sum8(acc[i][j]);
            for (long kk = k; kk < K; kk++) s += w[(size_t)(n + i) * K + kk] * x[(size_t)(m + j) * K + kk];
            out[(size_t)(m + j) * N + n + i] = s;
        }
}

/* Every input row against nw weight rows from n; each pass prefetches the rows ahead (a line already there costs
 * little, and the later passes measured faster with it than without). */
static inline __attribute__((always_inline)) void rows_of(const float *x, long M, long K, const float *w, long N,
                                                          float *out, long n, int nw, long n_end) {
    const float *ahead = n + PREFETCH_ROWS + nw <= n_end ? w + (size_t)(n + PREFETCH_ROWS) * K : NULL;
    long m = 0;
    for (; m + MR <= M; m += MR) tile(x, K, w, N, out, n, m, nw, MR, ahead);
    for (; m + 2 <= M; m += 2) tile(x, K, w, N, out, n, m, nw, 2, ahead);
    for (; m < M; m++) tile(x, K, w, N, out, n, m, nw, 1, ahead);
}

void pagedesk_rows_gemm(const float *x, long M, long K, const float *w, long N, float *out, long n0, long n1) {
    long n = n0;
    for (; n + NW <= n1; n += NW) rows_of(x, M, K, w, N, out, n, NW, n1);
    for (; n < n1; n++) rows_of(x, M, K, w, N, out, n, 1, n1);
}

void pagedesk_pool_run(void (*run)(const void *args, long chunk), const void *args, long chunks, long threads);

typedef struct {
    const float *x, *w;
    float *out;
    long M, K, N, chunk_rows;
} gemm_job;

static void gemm_chunk(const void *args, long chunk) {
    const gemm_job *job = args;
    long first = chunk * job->chunk_rows;
    pagedesk_rows_gemm(job->x, job->M, job->K, job->w, job->N, job->out, first,
                       first + job->chunk_rows < job->N ? first + job->chunk_rows : job->N);
}

/* out = x w^T on `threads` threads, the output features cut into about chunks_per_thread chunks per thread (each a
 * multiple of the tile's NW rows), taken first come first served. */
void pagedesk_rows_gemm_parallel(const float *x, long M, long K, const float *w, long N, float *out,
                                 long chunks_per_thread, long threads) {
    long chunk_rows = (N + chunks_per_thread * threads - 1) / (chunks_per_thread * threads);
    chunk_rows = chunk_rows < NW ? NW : chunk_rows + (NW - chunk_rows % NW) % NW;
    gemm_job job = {x, w, out, M, K, N, chunk_rows};
    pagedesk_pool_run(gemm_chunk, &job, (N + chunk_rows - 1) / chunk_rows, threads);
}
