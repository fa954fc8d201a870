/* The thread pool of the native decode kernels (kernels/rows_gemm.c, kernels/decode_attention.c), built into one
 * library with them by kernels/native_kernels.py.
 *
 * A parallel call is a job of `chunks` independent pieces (features of a linear, sequences of an attention); the
 * calling thread posts it, works on it too, and returns once every chunk is done, not once every worker has
 * arrived: a worker the OS has not run yet (the machine's other programs, the server's event loop and its client
 * share the cores) finds the job gone when it wakes and holds up nothing. numba's OpenMP pool, which drove the
 * linears before, joined every thread at the end of each parallel region: served through the HTTP server the
 * linears then took 1.5-2x their offline time (BENCHMARKS.md). A worker spins SPIN_NS after its last chunk, since a
 * step's next kernel comes tens of microseconds later, then sleeps on a condition variable (0, 50 and 1000 us
 * measured no better served).
 *
 * The job's number of chunks and its next chunk share one 64-bit word (`ticket`), so a chunk is claimed by one
 * compare-and-swap. The job itself is read only after a claim: the caller cannot post the next job while a chunk
 * of this one is unfinished, so it is the claimed chunk's. One caller at a time posts; another thread calling
 * meanwhile runs its job alone. A forked child starts workers of its own. */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

enum { MAX_WORKERS = 63 };
#define SPIN_NS 200000L

typedef void (*chunk_fn)(const void *args, long chunk);

static struct {
    uint64_t ticket;          /* chunks << 32 | next chunk */
    long done;                /* chunks of the posted job finished */
    unsigned long wake;       /* bumped per job: what the workers wait on */
    int sleepers;             /* workers asleep on `posted` (or about to be) */
    chunk_fn run;             /* the posted job */
    const void *args;
    pthread_mutex_t lock;     /* the sleepers' */
    pthread_cond_t posted;
    pthread_mutex_t callers;  /* one posting thread at a time */
    int workers;
    int helping;              /* workers the posted job may use: its threads - 1 (the pool may have more) */
    pid_t pid;                /* the process the workers were started in */
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
        pool.run(pool.args, (long)(t & 0xffffffffu));
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

/* run(args, c) for every chunk c in [0, chunks), on `threads` threads: the caller and threads - 1 workers. */
void pagedesk_pool_run(chunk_fn run, const void *args, long chunks, long threads) {
    if (threads < 2 || chunks < 2 || chunks > 0x7fffffffL || pthread_mutex_trylock(&pool.callers) != 0) {
        for (long c = 0; c < chunks; c++) run(args, c);  /* alone (or another thread is posting) */
        return;
    }
    if (ensure_workers(threads) == 0) {
        pthread_mutex_unlock(&pool.callers);
        for (long c = 0; c < chunks; c++) run(args, c);
        return;
    }
    pool.run = run;
    pool.args = args;
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
