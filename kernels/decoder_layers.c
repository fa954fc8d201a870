/* Every layer of a Llama-style decoder over a decode step's rows, in one call: per layer RMSNorm (the residual add
 * fused in), the QKV GEMM (and its bias), Qwen3's per-head q/k norms, RoPE on q and k, the KV write and paged
 * attention, the O GEMM, the second norm, the gate/up GEMM, SiLU(gate) * up and the down GEMM. Each piece is the
 * library's own function, the one the layer modules call one at a time (kernels/rows_gemm.c,
 * kernels/decode_attention.c, kernels/host_ops.c), so the result is theirs bit for bit (the q/k norms excepted: the
 * modules leave those strided views to torch, whose sum of squares runs in another order); what goes is the Python
 * between them: ~40 frames, tensor headers and dispatches a layer, each run on caches the step's weights have just
 * streamed through (BENCHMARKS.md). Built into the native library by kernels/native_kernels.py, driven by
 * kernels/cpu_decoder.py.
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
void pagedesk_rope(float *x, long rows, long row_stride, long heads, long head_dim, long rotary_dim,
                   const float *cos, const float *sin);
void pagedesk_decode_attention(const float *q, long q_stride, float *k_cache, float *v_cache, long num_heads,
                               long num_kv_heads, long head_dim, long block_size, long block_stride,
                               long token_stride, long head_stride, const int32_t *tables, long table_width,
                               const int64_t *seq_lens, const int64_t *rows, long num_seqs, float scale,
                               long window, float soft_cap, const float *sinks, long heads_per_item, float *out,
                               const float *k_new, const float *v_new, long new_stride, const int64_t *slots,
                               long threads);

typedef struct {  /* one layer's weights ([out, in], C-contiguous), the linears' biases and the per-head q/k norms'
                   * weights (NULL: none), its KV caches */
    const float *input_norm, *qkv, *o, *post_norm, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias, *q_norm, *k_norm;
    float *k_cache, *v_cache;
} decoder_layer;

typedef struct {  /* the model's shapes and the kernels' settings, the same for every layer */
    long layers, hidden, heads, kv_heads, head_dim, rotary_dim, intermediate;
    long block_size, block_stride, token_stride, head_stride;  /* the caches', in floats */
    float eps, norm_offset, scale;
    long linear_min_work;     /* multiply-adds under which a GEMM runs on the calling thread */
    long chunks_per_thread;   /* a parallel GEMM's chunks per thread */
    const decoder_layer *layer;
} decoder_spec;

/* out = x w^T (+ bias, added after the sum as the module's `out += bias`). */
static void linear(const decoder_spec *s, const float *x, long M, long K, const float *w, const float *bias, long N,
                   float *out, long threads) {
    if (threads > 1 && M * N * K >= s->linear_min_work)
        pagedesk_rows_gemm_parallel(x, M, K, w, N, out, s->chunks_per_thread, threads);
    else
        pagedesk_rows_gemm(x, M, K, w, N, out, 0, N);
    if (bias)
        for (long m = 0; m < M; m++)
            for (long n = 0; n < N; n++) out[m * N + n] += bias[n];
}

/* Sequence i is row rows[i] (a decode step: one row each); window, attention_threads and heads_per_item as
 * pagedesk_decode_attention takes them; threads: the GEMMs' pool size. */
void pagedesk_decoder_layers(const decoder_spec *s, long M, float *x, float *residual, float *scratch,
                             const float *cos, const float *sin, const int32_t *tables, long table_width,
                             const int64_t *seq_lens, const int64_t *rows, long num_seqs, const int64_t *slots,
                             long window, long attention_threads, long heads_per_item, long threads) {
    long H = s->hidden, D = s->head_dim, I = s->intermediate;
    long q_width = s->heads * D, kv_width = s->kv_heads * D, qkv_width = q_width + 2 * kv_width;
    float *normed = scratch, *qkv = normed + M * H, *attended = qkv + M * qkv_width;
    float *gate_up = attended + M * q_width, *act = gate_up + M * 2 * I;
    for (long l = 0; l < s->layers; l++) {
        const decoder_layer *layer = s->layer + l;
        if (l == 0) {  /* no residual yet: the embeddings are it */
            memcpy(residual, x, (size_t)(M * H) * sizeof(float));
            pagedesk_rms_norm(residual, NULL, layer->input_norm, s->norm_offset, s->eps, M, H, normed, NULL);
        } else {
            pagedesk_rms_norm(x, residual, layer->input_norm, s->norm_offset, s->eps, M, H, normed, residual);
        }
        linear(s, normed, M, H, layer->qkv, layer->qkv_bias, qkv_width, qkv, threads);
        if (layer->q_norm)  /* Qwen3: each head of q and k normed, in place, before RoPE */
            for (long m = 0; m < M; m++) {
                float *q = qkv + m * qkv_width, *k = q + q_width;
                pagedesk_rms_norm(q, NULL, layer->q_norm, s->norm_offset, s->eps, s->heads, D, q, NULL);
                pagedesk_rms_norm(k, NULL, layer->k_norm, s->norm_offset, s->eps, s->kv_heads, D, k, NULL);
            }
        pagedesk_rope(qkv, M, qkv_width, s->heads + s->kv_heads, D, s->rotary_dim, cos, sin);
        pagedesk_decode_attention(qkv, qkv_width, layer->k_cache, layer->v_cache, s->heads, s->kv_heads, D,
                                  s->block_size, s->block_stride, s->token_stride, s->head_stride, tables,
                                  table_width, seq_lens, rows, num_seqs, s->scale, window, 0.0f, NULL,
                                  heads_per_item, attended, qkv + q_width, qkv + q_width + kv_width, qkv_width,
                                  slots, attention_threads);
        linear(s, attended, M, q_width, layer->o, layer->o_bias, H, x, threads);
        pagedesk_rms_norm(x, residual, layer->post_norm, s->norm_offset, s->eps, M, H, normed, residual);
        linear(s, normed, M, H, layer->gate_up, layer->gate_up_bias, 2 * I, gate_up, threads);
        pagedesk_silu_mul(gate_up, M, I, act);
        linear(s, act, M, I, layer->down, layer->down_bias, H, x, threads);
    }
}
