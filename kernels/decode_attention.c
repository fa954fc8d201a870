/* Paged decode attention over a float32 KV cache on the CPU: out[rows[s], h] = softmax(q . K^T * scale) V over the
 * last min(seq_len, window) tokens of sequence s, read in place from the block pool. The native build of
 * kernels/attention_cpu.py's numba kernel for float32 caches (integer caches stay on numba's), compiled on the
 * user's machine by kernels/native_build.py and run on the pool of kernels/native_pool.c.
 *
 * One chunk per (sequence, run of heads_per_item KV heads), two passes over its tokens in cache order, as numba's:
 * the scores of every query head of the run (each K row read once for the heads sharing it), a softmax per head,
 * then the weighted sum of V rows, so K and V are read as the contiguous runs a block lays out. (A one-pass online
 * softmax measured 2-3x slower on one sequence: an exp and a dependent rescale per token and head.) soft_cap 0
 * means none; sinks NULL means none, else sinks[h] is one more logit of head h in the denominator. Caches are
 * [blocks, block_size, kv_heads, head_dim] with any strides but the last (a view of the engine's block pool); q
 * out is contiguous [tokens, heads, head_dim], q's rows are q_stride floats apart (its heads contiguous within a row:
 * the QKV projection's output is read in place). Sums run in another order than numba's and torch's: results
 * agree to float32 rounding.
 *
 * k_new and v_new (NULL: none), a decode-only step's new keys and values [tokens, kv_heads, head_dim] with rows
 * new_stride floats apart, are written at slots[row] of the caches by the chunk that reads them, before it reads:
 * the step's KV write without a call, a conversion and a cold pass of its own. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

void pagedesk_pool_run(void (*run)(const void *args, long chunk), const void *args, long chunks, long threads);

typedef struct {
    const float *q;
    long q_stride;
    float *k_cache, *v_cache;
    long num_heads, num_kv_heads, head_dim, block_size;
    long block_stride, token_stride, head_stride;  /* the caches', in floats */
    const int32_t *tables;
    long table_width;
    const int64_t *seq_lens, *rows;
    float scale, soft_cap;
    long window;
    const float *sinks;
    long heads_per_item;
    float *out;
    const float *k_new, *v_new;
    long new_stride;
    const int64_t *slots;
} attention_job;

static inline float dot(const float *a, const float *b, long n) {
    v8 acc = {0};
    long d = 0;
    for (; d + 8 <= n; d += 8) {
        v8 x, y;
        memcpy(&x, a + d, sizeof x);
        memcpy(&y, b + d, sizeof y);
        acc += x * y;
    }
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* acc += p * v, over n floats. */
static inline void add_scaled(float *acc, float p, const float *v, long n) {
    for (long d = 0; d < n; d++) acc[d] += p * v[d];
}

static void attention_item(const void *args, long item) {
    const attention_job *j = args;
    long runs = (j->num_kv_heads + j->heads_per_item - 1) / j->heads_per_item;
    long s = item / runs, kv_first = item % runs * j->heads_per_item;
    long kv_last = kv_first + j->heads_per_item < j->num_kv_heads ? kv_first + j->heads_per_item : j->num_kv_heads;
    long group = j->num_heads / j->num_kv_heads, D = j->head_dim, bs = j->block_size;
    long h_first = kv_first * group, count = (kv_last - kv_first) * group;
    long row = j->rows[s], seq_len = j->seq_lens[s];
    long first = seq_len > j->window ? seq_len - j->window : 0, n = seq_len - first;
    float acc[count * D], small[count * 64];  /* the scores of contexts up to 64 tokens stay on the stack */
    float *scores = n <= 64 ? small : malloc((size_t)(count * n) * sizeof(float));
    if (!scores) abort();  /* a few hundred KiB not to be had: no result is better than a wrong one */
    memset(acc, 0, sizeof acc);
    const float *q = j->q + row * j->q_stride + h_first * D;
    const int32_t *table = j->tables + s * j->table_width;
    if (j->k_new) {  /* this row's new key and value at its slot, before the passes read them */
        long slot = j->slots[row], at = slot / bs * j->block_stride + slot % bs * j->token_stride;
        for (long kvh = kv_first; kvh < kv_last; kvh++) {
            long from = row * j->new_stride + kvh * D, to = at + kvh * j->head_stride;
            memcpy(j->k_cache + to, j->k_new + from, (size_t)D * sizeof(float));
            memcpy(j->v_cache + to, j->v_new + from, (size_t)D * sizeof(float));
        }
    }
    for (long t = 0; t < n; t++) {  /* scores, token by token: each K row read once for the heads sharing it */
        long pos = first + t, at = (long)table[pos / bs] * j->block_stride + pos % bs * j->token_stride;
        for (long kvh = kv_first; kvh < kv_last; kvh++) {
            const float *k = j->k_cache + at + kvh * j->head_stride;
            for (long g = 0; g < group; g++) {
                long i = (kvh - kv_first) * group + g;
                float score = dot(q + i * D, k, D) * j->scale;
                if (j->soft_cap > 0.0f) score = tanhf(score / j->soft_cap) * j->soft_cap;
                scores[i * n + t] = score;
            }
        }
    }
    for (long i = 0; i < count; i++) {  /* softmax per head, the sink as one more logit */
        float *sc = scores + i * n, m = -INFINITY, total = 0.0f;
        for (long t = 0; t < n; t++) m = sc[t] > m ? sc[t] : m;
        if (j->sinks) {
            float sink = j->sinks[h_first + i];
            m = sink > m ? sink : m;
            total = expf(sink - m);
        }
        for (long t = 0; t < n; t++) {
            sc[t] = expf(sc[t] - m);
            total += sc[t];
        }
        float inv = 1.0f / total;
        for (long t = 0; t < n; t++) sc[t] *= inv;
    }
    for (long t = 0; t < n; t++) {  /* the weighted sum of V rows, token by token */
        long pos = first + t, at = (long)table[pos / bs] * j->block_stride + pos % bs * j->token_stride;
        for (long kvh = kv_first; kvh < kv_last; kvh++) {
            const float *v = j->v_cache + at + kvh * j->head_stride;
            for (long g = 0; g < group; g++) {
                long i = (kvh - kv_first) * group + g;
                add_scaled(acc + i * D, scores[i * n + t], v, D);
            }
        }
    }
    for (long i = 0; i < count; i++) memcpy(j->out + (row * j->num_heads + h_first + i) * D, acc + i * D,
                                            (size_t)D * sizeof(float));
    if (scores != small) free(scores);
}

void pagedesk_decode_attention(const float *q, long q_stride, float *k_cache, float *v_cache, long num_heads,
                               long num_kv_heads, long head_dim, long block_size, long block_stride,
                               long token_stride, long head_stride, const int32_t *tables, long table_width,
                               const int64_t *seq_lens, const int64_t *rows, long num_seqs, float scale,
                               long window, float soft_cap, const float *sinks, long heads_per_item, float *out,
                               const float *k_new, const float *v_new, long new_stride, const int64_t *slots,
                               long threads) {
    attention_job job = {q, q_stride, k_cache, v_cache, num_heads, num_kv_heads, head_dim, block_size, block_stride,
                         token_stride, head_stride, tables, table_width, seq_lens, rows, scale, soft_cap, window,
                         sinks, heads_per_item, out, k_new, v_new, new_stride, slots};
    long runs = (num_kv_heads + heads_per_item - 1) / heads_per_item;
    pagedesk_pool_run(attention_item, &job, num_seqs * runs, threads);
}
