/* Paged decode attention over a float32 KV cache on the CPU: out[rows[s], h] = softmax(q . K^T * scale) V over the
 * last min(seq_len, window) tokens of sequence s, read in place from the block pool. The native build of
 * kernels/attention_cpu.py's numba kernel for float32 caches (integer caches stay on numba's), compiled on the
 * user's machine by kernels/native_build.py and run on the pool of kernels/native_pool.c.
 *
 * One chunk per (sequence, run of heads_per_item KV heads), one pass over its tokens in cache order with an online
 * softmax (a running maximum and sum per query head; the accumulated values rescaled when the maximum grows), so
 * K and V rows are read once each, token by token, as the contiguous runs a block lays out, and no scores buffer
 * of the context's length is needed. soft_cap 0 means none; sinks NULL means none, else sinks[h] is one more logit
 * of head h in the denominator. Caches are [blocks, block_size, kv_heads, head_dim] with any strides but the last
 * (a view of the engine's block pool); q and out are contiguous [tokens, heads, head_dim]. Sums run in another
 * order than numba's and torch's: results agree to float32 rounding. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

void pagedesk_pool_run(void (*run)(const void *args, long chunk), const void *args, long chunks, long threads);

typedef struct {
    const float *q, *k_cache, *v_cache;
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

/* acc = acc * c + p * v, over n floats. */
static inline void scale_add(float *acc, float c, float p, const float *v, long n) {
    for (long d = 0; d < n; d++) acc[d] = acc[d] * c + p * v[d];
}

static void attention_item(const void *args, long item) {
    const attention_job *j = args;
    long runs = (j->num_kv_heads + j->heads_per_item - 1) / j->heads_per_item;
    long s = item / runs, kv_first = item % runs * j->heads_per_item;
    long kv_last = kv_first + j->heads_per_item < j->num_kv_heads ? kv_first + j->heads_per_item : j->num_kv_heads;
    long group = j->num_heads / j->num_kv_heads, D = j->head_dim, bs = j->block_size;
    long h_first = kv_first * group, count = (kv_last - kv_first) * group;
    long row = j->rows[s], seq_len = j->seq_lens[s];
    long first = seq_len > j->window ? seq_len - j->window : 0;
    float acc[count * D], top[count], total[count];
    memset(acc, 0, sizeof acc);
    for (long i = 0; i < count; i++) top[i] = -INFINITY, total[i] = 0.0f;
    const float *q = j->q + (row * j->num_heads + h_first) * D;
    const int32_t *table = j->tables + s * j->table_width;
    for (long pos = first; pos < seq_len; pos++) {
        long at = (long)table[pos / bs] * j->block_stride + pos % bs * j->token_stride;
        for (long kvh = kv_first; kvh < kv_last; kvh++) {
            const float *k = j->k_cache + at + kvh * j->head_stride, *v = j->v_cache + at + kvh * j->head_stride;
            for (long g = 0; g < group; g++) {
                long i = (kvh - kv_first) * group + g;
                float score = dot(q + i * D, k, D) * j->scale;
                if (j->soft_cap > 0.0f) score = tanhf(score / j->soft_cap) * j->soft_cap;
                float c = 1.0f;
                if (score > top[i]) {  /* a new maximum: what was summed so far shrinks by exp(old - new) */
                    c = expf(top[i] - score);
                    top[i] = score;
                }
                float p = expf(score - top[i]);
                total[i] = total[i] * c + p;
                scale_add(acc + i * D, c, p, v, D);
            }
        }
    }
    for (long i = 0; i < count; i++) {
        float factor = 1.0f, sum = total[i];
        if (j->sinks) {
            float sink = j->sinks[h_first + i], m = top[i] > sink ? top[i] : sink;
            factor = expf(top[i] - m);
            sum = sum * factor + expf(sink - m);
        }
        float *o = j->out + (row * j->num_heads + h_first + i) * D, inv = factor / sum;
        for (long d = 0; d < D; d++) o[d] = acc[i * D + d] * inv;
    }
}

void pagedesk_decode_attention(const float *q, const float *k_cache, const float *v_cache, long num_heads,
                               long num_kv_heads, long head_dim, long block_size, long block_stride,
                               long token_stride, long head_stride, const int32_t *tables, long table_width,
                               const int64_t *seq_lens, const int64_t *rows, long num_seqs, float scale,
                               long window, float soft_cap, const float *sinks, long heads_per_item, float *out,
                               long threads) {
    attention_job job = {q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, block_size, block_stride,
                         token_stride, head_stride, tables, table_width, seq_lens, rows, scale, soft_cap, window,
                         sinks, heads_per_item, out};
    long runs = (num_kv_heads + heads_per_item - 1) / heads_per_item;
    pagedesk_pool_run(attention_item, &job, num_seqs * runs, threads);
}
