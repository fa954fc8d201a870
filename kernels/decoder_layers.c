/* Every layer of a Llama-style decoder over a decode step's rows, in one call: per layer RMSNorm (the residual add
 * fused in), the QKV GEMM (and its bias), per-head q/k norms (Qwen3, Gemma 3), RoPE on q and k (each layer's table),
 * the KV write and paged attention (each layer's KV cache group: its block tables, slots and window; Gemma 2's soft
 * cap), the O GEMM, the second norm (Gemma's sandwich: the attention's and the MLP's outputs normed too), the
 * gate/up GEMM, SiLU or GELU-tanh of the gate times up, and the down GEMM. Each piece is the library's own function,
 * the one the layer modules call one at a time (kernels/rows_gemm.c, kernels/decode_attention.c,
 * kernels/host_ops.c), so the result is theirs bit for bit (the q/k norms excepted: the modules leave those strided
 * views to torch, whose sum of squares runs in another order); what goes is the Python between them: ~40 frames,
 * tensor headers and dispatches a layer, each run on caches the step's weights have just streamed through
 * (BENCHMARKS.md). Built into the native library by kernels/native_kernels.py, driven by kernels/cpu_decoder.py.
 *
 * x [rows, hidden] holds the embeddings on entry and the last layer's output (its MLP's, before the residual add)
 * on return; residual [rows, hidden] the sum the last layer's MLP adds to, as the module path's layers return
 * them. scratch holds rows * (hidden + qkv width + q width + 3 * intermediate) floats. */
#include <stdint.h>
#include <string.h>

void pagedesk_rows_gemm(const float *x, long M, long K, const float *w, long N, float *out, long n0, long n1);
void pagedesk_rows_gemm_parallel(const float *x, long M, long K, const float *w, long N, float *out,
                                 long chunks_per_thread, long threads);
void pagedesk_rms_norm(const float *x, const float *residual, const float *weight, float offset, float eps,
                       long rows, long n, float *out, float *sum_out);
void pagedesk_silu_mul(const float *gate_up, long rows, long width, float *out);
void pagedesk_gelu_tanh_mul(const float *gate_up, long rows, long width, float *out);
void pagedesk_gguf_gemm(long type, const float *x, long M, long K, const uint8_t *w, long row_bytes, long N,
                        float *out, long out_stride, long chunks_per_thread, long threads);
void pagedesk_rope(float *x, long rows, long row_stride, long heads, long head_dim, long rotary_dim,
                   const float *cos, const float *sin);
void pagedesk_decode_attention(const float *q, long q_stride, float *k_cache, float *v_cache, long num_heads,
                               long num_kv_heads, long head_dim, long block_size, long block_stride,
                               long token_stride, long head_stride, const int32_t *tables, long table_width,
                               const int64_t *seq_lens, const int64_t *rows, long num_seqs, float scale,
                               long window, float soft_cap, const float *sinks, long heads_per_item, float *out,
                               const float *k_new, const float *v_new, long new_stride, const int64_t *slots,
                               long threads);

enum { MAX_GROUPS = 16, MAX_ROPES = 4, MAX_RUNS = 4 };  /* kernels/cpu_decoder.py has the same */

typedef struct {  /* consecutive output features of a linear in one format */
    long type;          /* -1: float32 [rows, in]; else a ggml type of kernels/gguf_gemm.c */
    const void *w;
    long rows, row_bytes;
} weight_run;

typedef struct {  /* a linear's weight: one float32 run, or a GGUF file's runs (a Q4_K_M QKV: Q4_K q, k, Q6_K v) */
    long runs;
    weight_run run[MAX_RUNS];
} weight;

typedef struct {  /* one layer's weights, the linears' biases, the per-head q/k norms' and the sandwich norms'
                   * weights (NULL: none), its KV caches, its KV cache group and RoPE table */
    const float *input_norm;
    weight qkv, o;
    const float *post_norm;
    weight gate_up, down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias, *q_norm, *k_norm, *pre_ff_norm, *post_ff_norm;
    float *k_cache, *v_cache;
    long group, rope;  /* rope -1: none */
} decoder_layer;

typedef struct {  /* the model's shapes and the kernels' settings, the same for every layer */
    long layers, hidden, heads, kv_heads, head_dim, intermediate;
    long block_size, block_stride, token_stride, head_stride;  /* the caches', in floats */
    float eps, norm_offset, scale, soft_cap;                  /* soft_cap 0: none */
    long gelu;                /* the MLP's activation: 0 SiLU, 1 GELU-tanh */
    long linear_min_work;     /* multiply-adds under which a GEMM runs on the calling thread */
    long chunks_per_thread;   /* a parallel GEMM's chunks per thread */
    long rotary_dim[MAX_ROPES];
    const decoder_layer *layer;
} decoder_spec;

typedef struct {  /* a KV cache group's view of the step, as pagedesk_decode_attention takes it */
    const int32_t *tables;
    long table_width;
    const int64_t *slots;
    long window, attention_threads, heads_per_item;
} step_group;

typedef struct {  /* the step: sequence i is row rows[i] (one decode each); each RoPE table's cos and sin */
    const int64_t *seq_lens, *rows;
    long num_seqs;
    step_group group[MAX_GROUPS];
    const float *cos[MAX_ROPES], *sin[MAX_ROPES];
} decoder_step;

/* out = x w^T (+ bias, added after the sum as the module's `out += bias`): a float32 weight through the row GEMM,
 * each GGUF run through the block GEMM into its columns of out. */
static void linear(const decoder_spec *s, const float *x, long M, long K, const weight *w, const float *bias, long N,
                   float *out, long threads) {
    long column = 0;
    for (long r = 0; r < w->runs; r++) {
        const weight_run *run = w->run + r;
        long t = threads > 1 && M * run->rows * K >= s->linear_min_work ? threads : 1;
        if (run->type < 0 && t > 1)  /* a float32 weight is one run: the whole of out */
            pagedesk_rows_gemm_parallel(x, M, K, run->w, N, out, s->chunks_per_thread, t);
        else if (run->type < 0)
            pagedesk_rows_gemm(x, M, K, run->w, N, out, 0, N);
        else
            pagedesk_gguf_gemm(run->type, x, M, K, run->w, run->row_bytes, run->rows, out + column, N,
                               s->chunks_per_thread, t);
        column += run->rows;
    }
    if (bias)
        for (long m = 0; m < M; m++)
            for (long n = 0; n < N; n++) out[m * N + n] += bias[n];
}

/* A norm over rows of n floats with the model's eps and offset; sum_out / residual as pagedesk_rms_norm's. */
static void norm(const decoder_spec *s, const float *x, const float *residual, const float *weight, long rows, long n,
                 float *out, float *sum_out) {
    pagedesk_rms_norm(x, residual, weight, s->norm_offset, s->eps, rows, n, out, sum_out);
}

/* threads: the GEMMs' pool size. */
void pagedesk_decoder_layers(const decoder_spec *s, long M, float *x, float *residual, float *scratch,
                             const decoder_step *step, long threads) {
    long H = s->hidden, D = s->head_dim, I = s->intermediate;
    long q_width = s->heads * D, kv_width = s->kv_heads * D, qkv_width = q_width + 2 * kv_width;
    float *normed = scratch, *qkv = normed + M * H, *attended = qkv + M * qkv_width;
    float *gate_up = attended + M * q_width, *act = gate_up + M * 2 * I;
    for (long l = 0; l < s->layers; l++) {
        const decoder_layer *layer = s->layer + l;
        const step_group *g = step->group + layer->group;
        if (l == 0) {  /* no residual yet: the embeddings are it */
            memcpy(residual, x, (size_t)(M * H) * sizeof(float));
            norm(s, residual, NULL, layer->input_norm, M, H, normed, NULL);
        } else {
            norm(s, x, residual, layer->input_norm, M, H, normed, residual);
        }
        linear(s, normed, M, H, &layer->qkv, layer->qkv_bias, qkv_width, qkv, threads);
        if (layer->q_norm)  /* Qwen3, Gemma 3: each head of q and k normed, in place, before RoPE */
            for (long m = 0; m < M; m++) {
                float *q = qkv + m * qkv_width, *k = q + q_width;
                norm(s, q, NULL, layer->q_norm, s->heads, D, q, NULL);
                norm(s, k, NULL, layer->k_norm, s->kv_heads, D, k, NULL);
            }
        if (layer->rope >= 0)  /* -1: a layer without positions (SmolLM3's NoPE layers) */
            pagedesk_rope(qkv, M, qkv_width, s->heads + s->kv_heads, D, s->rotary_dim[layer->rope],
                          step->cos[layer->rope], step->sin[layer->rope]);
        pagedesk_decode_attention(qkv, qkv_width, layer->k_cache, layer->v_cache, s->heads, s->kv_heads, D,
                                  s->block_size, s->block_stride, s->token_stride, s->head_stride, g->tables,
                                  g->table_width, step->seq_lens, step->rows, step->num_seqs, s->scale, g->window,
                                  s->soft_cap, NULL, g->heads_per_item, attended, qkv + q_width,
                                  qkv + q_width + kv_width, qkv_width, g->slots, g->attention_threads);
        linear(s, attended, M, q_width, &layer->o, layer->o_bias, H, x, threads);
        if (layer->pre_ff_norm) {  /* Gemma's sandwich: the attention's output normed, then added */
            norm(s, x, NULL, layer->post_norm, M, H, x, NULL);
            norm(s, x, residual, layer->pre_ff_norm, M, H, normed, residual);
        } else {
            norm(s, x, residual, layer->post_norm, M, H, normed, residual);
        }
        linear(s, normed, M, H, &layer->gate_up, layer->gate_up_bias, 2 * I, gate_up, threads);
        (s->gelu ? pagedesk_gelu_tanh_mul : pagedesk_silu_mul)(gate_up, M, I, act);
        linear(s, act, M, I, &layer->down, layer->down_bias, H, x, threads);
        if (layer->post_ff_norm) norm(s, x, NULL, layer->post_ff_norm, M, H, x, NULL);
    }
}
