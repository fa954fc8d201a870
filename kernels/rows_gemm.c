/* out[m, n] = sum_k x[m, k] * w[n, k] for the output features n in [n0, n1): a float32 GEMM for the few rows of a
 * decode step on the CPU, compiled on the user's machine by kernels/native_build.py (-O3 -march=native), and run in
 * parallel over output features on this library's own thread pool (below). x [M, K], w [N, K] (torch's [out, in]) and
 * out [M, N] are C-contiguous.
 *
 * Each tile multiplies NW weight rows by MR input rows with NW x MR vector accumulators (12 of the 16 AVX2
 * registers), so a loaded weight vector serves MR rows and a loaded input vector NW weight rows; the weight rows
 * PREFETCH_ROWS ahead are prefetched as the tile walks k (1 line per 8 floats; weights stream from memory once
 * per step, and the hardware prefetcher alone left the 2-core machine's linears 20-30% slower, BENCHMARKS.md).
 * The sums run in another order than torch's BLAS: results agree to float32 rounding. GCC/Clang vector extensions,
 * no intrinsics: the same source builds for AVX2, AVX-512 (as 256-bit) and NEON. */
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
            if (ahead) __builtin_prefetch(ahead + (size_t)i * K + k, 0, 0);
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


/* The pool. A parallel call is a job of `total` chunks of features; the calling thread posts it, works on it too,
 * and returns once every chunk is done, not once every worker has arrived: a worker the OS has not run yet (the
 * machine's other programs, the server's event loop and its client share the cores) finds the job gone when it
 * wakes and holds up nothing. numba's OpenMP pool, which drove this kernel before, joined every thread at the end
 * of each parallel region: served through the HTTP server the linears then took twice their offline time
 * (BENCHMARKS.md). A worker spins SPIN_NS after its last chunk, since a step's next linear comes tens of
 * microseconds later, then sleeps on a condition variable.
 *
 * The job's number of chunks and its next chunk share one 64-bit word (`ticket`), so a chunk is claimed by one
 * compare-and-swap. The job's arguments are read only after a claim: the caller cannot post the next job while a
 * chunk of this one is unfinished, so they are the claimed chunk's. */
enum { MAX_WORKERS = 63 };
#define SPIN_NS 200000L

typedef struct {
    const float *x, *w;
    float *out;
    long M, K, N, chunk_rows;
} gemm_job;

static struct {
    uint64_t ticket;         /* chunks << 32 | next chunk */
    long done;               /* chunks of the posted job finished */
    unsigned long wake;      /* bumped per job: what the workers wait on */
    int sleepers;            /* workers asleep on `posted` (or about to be) */
    gemm_job job;
    pthread_mutex_t lock;    /* the sleepers' */
    pthread_cond_t posted;
    pthread_mutex_t callers; /* one posting thread at a time; another caller runs its GEMM alone */
    int workers;
    int helping;             /* workers the posted job may use: threads - 1 of the call (the pool may have more) */
    pid_t pid;               /* the process the workers were started in (a forked child has none) */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .posted = PTHREAD_COND_INITIALIZER,
          .callers = PTHREAD_MUTEX_INITIALIZER};

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Claim and run chunks of the posted job until none is left. */
static void work(void) {
    for (;;) {
        uint64_t t = __atomic_load_n(&pool.ticket, __ATOMIC_ACQUIRE);
        if ((t & 0xffffffffu) >= t >> 32) return;
        if (!__atomic_compare_exchange_n(&pool.ticket, &t, t + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) continue;
        const gemm_job *job = &pool.job;
        long next = (long)(t & 0xffffffffu);
        long first = (long)next * job->chunk_rows;
        long last = first + job->chunk_rows < job->N ? first + job->chunk_rows : job->N;
        pagedesk_rows_gemm(job->x, job->M, job->K, job->w, job->N, job->out, first, last);
        __atomic_fetch_add(&pool.done, 1, __ATOMIC_RELEASE);
    }
}

static void *worker(void *arg) {
    int index = (int)(long)arg;
    unsigned long seen = __atomic_load_n(&pool.wake, __ATOMIC_ACQUIRE);
    for (;;) {
        if (index < __atomic_load_n(&pool.helping, __ATOMIC_ACQUIRE)) work();
        long until = now_ns() + SPIN_NS;
        for (int spins = 1;; spins++) {  /* spin a while for the next job, then sleep until it is posted */
            unsigned long wake = __atomic_load_n(&pool.wake, __ATOMIC_ACQUIRE);
            if (wake != seen) {
                seen = wake;
                break;
            }
            cpu_relax();
            if (spins % 64 == 0 && now_ns() > until) {
                pthread_mutex_lock(&pool.lock);
                __atomic_fetch_add(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                while (__atomic_load_n(&pool.wake, __ATOMIC_SEQ_CST) == seen)
                    pthread_cond_wait(&pool.posted, &pool.lock);
                __atomic_fetch_sub(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                pthread_mutex_unlock(&pool.lock);
            }
        }
    }
    return NULL;
}

/* Workers up to `threads - 1` (the caller is the last thread); returns how many there are. */
static int ensure_workers(long threads) {
    pid_t pid = getpid();
    if (pool.pid != pid) {  /* the first call, or a forked child: the parent's workers are not in this process */
        pool.pid = pid, pool.workers = 0, pool.sleepers = 0;
        pthread_mutex_init(&pool.lock, NULL);
        pthread_cond_init(&pool.posted, NULL);
    }
    while (pool.workers < threads - 1 && pool.workers < MAX_WORKERS) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, worker, (void *)(long)pool.workers);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.workers++;
    }
    return pool.workers;
}

/* out = x w^T on `threads` threads (the caller and threads - 1 of the pool's workers), chunk_rows features a chunk. */
void pagedesk_rows_gemm_parallel(const float *x, long M, long K, const float *w, long N, float *out,
                                 long chunk_rows, long threads) {
    long chunks = (N + chunk_rows - 1) / chunk_rows;
    if (threads < 2 || chunks < 2 || chunks > 0x7fffffffL) {
        pagedesk_rows_gemm(x, M, K, w, N, out, 0, N);
        return;
    }
    if (pthread_mutex_trylock(&pool.callers) != 0) {  /* another thread's job is running: this one runs alone */
        pagedesk_rows_gemm(x, M, K, w, N, out, 0, N);
        return;
    }
    if (ensure_workers(threads) == 0) {
        pthread_mutex_unlock(&pool.callers);
        pagedesk_rows_gemm(x, M, K, w, N, out, 0, N);
        return;
    }
    pool.job = (gemm_job){x, w, out, M, K, N, chunk_rows};
    __atomic_store_n(&pool.helping, (int)threads - 1, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.ticket, (uint64_t)chunks << 32, __ATOMIC_RELEASE);
    __atomic_fetch_add(&pool.wake, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.posted);
        pthread_mutex_unlock(&pool.lock);
    }
    work();
    for (int spins = 1; __atomic_load_n(&pool.done, __ATOMIC_ACQUIRE) < chunks; spins++) {
        if (spins % 256 == 0) sched_yield();  /* a worker still in its last chunk, maybe preempted */
        else cpu_relax();
    }
    pthread_mutex_unlock(&pool.callers);
}
