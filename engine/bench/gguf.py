"""`pagedesk-bench gguf`: GGUF weights on CPU against float, the load time of a multi-GB file, and the planner's
verdicts for two GGUF checkpoints people run on 24 GB cards.

CPU: the bench Llama (engine/bench/random_model.py) is served in float32 from its safetensors folder and from
GGUF files of the same shapes at Q8_0 and Q4_K (random codes under valid fp16 scales, as `pagedesk-bench quant`
does for GPTQ: the speed does not depend on the values), each GGUF twice — as shipped (each linear dequantizes
its blocks on every call, kernels/gguf_torch.py) and with every linear's matrix dequantized once (float memory
again) — which is the measurement behind the CPU path's choice. `--forward-only` times single forwards instead,
interleaved. `--load-gib N` writes an N GiB Q8_0 Llama-shaped file and times an engine start from it against
reading the file into memory (the loader maps it; the layers copy each tensor's bytes once). The planner part is
torch-free: the tensor types of a llama.cpp Q4_K_M file of Qwen3.6-27B (text only; llama-quantize's Q4_K_M rules:
output Q6_K, attn_v and ffn_down Q6_K on the "more bits" layers, fused attn_qkv Q5_K, other matrices Q4_K, 1-D
tensors and the DeltaNet conv F32) and of gpt-oss-20b (MXFP4 experts, Q8_0 matrices, F32 vectors — an
assumption, see BENCHMARKS.md) are computed from their shapes and planned on one and two 24 GiB cards.
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

# ggml type -> (weights per block, bytes per block); the planner part stays torch- and gguf-free
BLOCKS = {"F32": (1, 4), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
          "MXFP4": (32, 17)}
CONTEXT = {"Qwen3.6-27B": 262_144, "gpt-oss-20b": 131_072}


def _nbytes(type_name: str, rows: int, cols: int) -> int:
    block, size = BLOCKS[type_name]
    return rows * (cols // block) * size


def _more_bits(i: int, n: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def qwen36_27b_q4_k_m() -> dict:
    """Qwen3.6-27B's text model (engine/bench/hybrid.py's config) with the byte counts of a Q4_K_M file."""
    from engine.bench.hybrid import QWEN3_6_27B
    t = QWEN3_6_27B["text_config"]
    h, layers, ffn, vocab = t["hidden_size"], t["num_hidden_layers"], t["intermediate_size"], t["vocab_size"]
    heads, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    lk, lv, ld = t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"]
    conv = 2 * lk * ld + lv * ld
    out: dict[str, int] = {}

    def add(type_name: str, rows: int, cols: int) -> None:
        out[type_name] = out.get(type_name, 0) + _nbytes(type_name, rows, cols)

    add("Q4_K", vocab, h)  # token_embd
    add("Q6_K", vocab, h)  # output
    full = [i for i in range(layers) if (i + 1) % t["full_attention_interval"] == 0]
    for i in range(layers):
        add("Q4_K", ffn, h)  # ffn_gate
        add("Q4_K", ffn, h)  # ffn_up
        add("Q6_K" if _more_bits(i, layers) else "Q4_K", h, ffn)  # ffn_down
        add("F32", 2, h)  # attn_norm, post_attention_norm
        if i in full:
            add("Q4_K", 2 * heads * hd, h)  # attn_q (with its output gate)
            add("Q4_K", kv * hd, h)  # attn_k
            add("Q6_K" if _more_bits(full.index(i), len(full)) else "Q4_K", kv * hd, h)  # attn_v
            add("Q4_K", h, heads * hd)  # attn_output
            add("F32", 2, hd)  # q/k norms
        else:
            add("Q5_K", conv, h)  # attn_qkv
            add("Q4_K", lv * ld, h)  # attn_gate (z)
            add("Q4_K", 2 * lv, h)  # ssm_alpha, ssm_beta
            add("Q4_K", h, lv * ld)  # ssm_out
            add("F32", conv, t["linear_conv_kernel_dim"])  # ssm_conv1d
            add("F32", 1, 2 * lv + ld)  # ssm_a, ssm_dt, ssm_norm
    add("F32", 1, h)  # output_norm
    text = {k: v for k, v in t.items() if k != "model_type"}
    return {**text, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            "tie_word_embeddings": False, "quantization_config": {"quant_method": "gguf", **out}}


def gpt_oss_20b_gguf() -> dict:
    """gpt-oss-20b with the byte counts of a GGUF that keeps its experts in MXFP4 and its matrices in Q8_0."""
    from engine.bench.moe_configs import GPT_OSS_20B
    c = GPT_OSS_20B
    h, layers, ffn, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    q, kv, experts = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"], \
        c["num_local_experts"]
    out = {"Q8_0": 2 * _nbytes("Q8_0", vocab, h) + layers * (_nbytes("Q8_0", q + 2 * kv, h) + _nbytes("Q8_0", h, q)),
           "MXFP4": layers * experts * (_nbytes("MXFP4", 2 * ffn, h) + _nbytes("MXFP4", h, ffn)),
           "F32": 4 * (layers * (2 * h + q + 2 * kv + h + c["num_attention_heads"] + experts * (h + 1)
                                 + experts * (2 * ffn + h)) + h)}
    hf = {k: v for k, v in c.items() if k != "quantization_config"}
    return {**hf, "quantization_config": {"quant_method": "gguf", **out}}


def planner_rows() -> None:
    from engine.config.model import ModelConfig
    from engine.planning.planner import plan_capacity
    from engine.planning.units import GIB
    print("\nFP8 KV, bf16 activations, --gpu-memory-utilization 0.9, CUDA graphs as the app plans them, "
          "max_num_seqs 4\n")
    print("| model | types | file | cards | weights/card | KV tokens that fit | verdict at its context |")
    print("|---|---|---:|---|---:|---:|---|")
    for name, hf in (("Qwen3.6-27B Q4_K_M", qwen36_27b_q4_k_m()), ("gpt-oss-20b GGUF", gpt_oss_20b_gguf())):
        context = CONTEXT[name.split(" ")[0]]
        for tp in (1, 2):
            cfg = ModelConfig.from_hf_config(hf)
            plan = plan_capacity(cfg, [24 * GIB] * tp, 0.9, dtype="bfloat16", kv_cache_dtype="fp8",
                                 tensor_parallel_size=tp, max_model_len=context, max_num_seqs=4, cuda_graphs=True)
            verdict = f"fits {plan.num_full_seqs} × {context:,}" if plan.fits else \
                f"{plan.num_tokens:,} tokens: not one full {context:,}-token sequence"
            file_bytes = sum(v for k, v in hf["quantization_config"].items() if k != "quant_method")
            print(f"| {name} | {cfg.quantization.describe()} | {file_bytes / GIB:.2f} GiB | {tp} × 24 GiB | "
                  f"{plan.weights_bytes / GIB:.2f} GiB | {plan.num_tokens:,} | {verdict} |", flush=True)


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0):
    """Valid blocks of random codes: fp16 scales small enough that activations stay finite."""
    import numpy as np
    block, size = BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, 256, (min(rows, 64), cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(1e-3 if type_name == "Q8_0" else 1e-4).tobytes(), dtype=np.uint8)
    for start in {"Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (size - 2,)}[type_name]:
        pattern[..., start:start + 2] = scale
    return np.tile(pattern, (-(-rows // pattern.shape[0]), 1, 1))[:rows].reshape(rows, -1)


def write_gguf_llama(path: Path, type_name: str, shape: dict) -> Path:
    """A GGUF of a Llama of `shape` (engine/bench/random_model.py's keys) with every matrix in `type_name`."""
    import gguf
    import numpy as np
    h, ffn, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv, vocab = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]
    hd = h // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(shape["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_eos_token_id(1)
    qtype = gguf.GGMLQuantizationType[type_name]
    matrices = {"token_embd": (vocab, h), "output": (vocab, h)}
    for i in range(layers):
        matrices.update({f"blk.{i}.attn_q": (h, h), f"blk.{i}.attn_k": (kv * hd, h), f"blk.{i}.attn_v": (kv * hd, h),
                         f"blk.{i}.attn_output": (h, h), f"blk.{i}.ffn_gate": (ffn, h), f"blk.{i}.ffn_up": (ffn, h),
                         f"blk.{i}.ffn_down": (h, ffn)})
    for n, name in enumerate(matrices):
        rows, cols = matrices[name]
        w.add_tensor(f"{name}.weight", random_blocks(type_name, rows, cols, n), raw_dtype=qtype)  # [rows, bytes]
    for name in ["output_norm"] + [f"blk.{i}.{n}" for i in range(layers) for n in ("attn_norm", "ffn_norm")]:
        w.add_tensor(f"{name}.weight", np.ones(h, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def cpu_rows(num_prompts: int, max_model_len: int) -> None:
    import torch

    from engine.bench.quant import run
    from engine.bench.random_model import BENCH_LLAMA, make_random_llama
    from engine.bench.workload import sharegpt_like
    with tempfile.TemporaryDirectory() as tmp:
        base = make_random_llama(Path(tmp) / "float")
        files = {t: write_gguf_llama(Path(tmp) / f"bench-{t}.gguf", t, BENCH_LLAMA) for t in ("Q8_0", "Q4_K")}
        requests = sharegpt_like(num_prompts, 8192, max_model_len, 0)
        out_tokens = sum(r.output_len for r in requests)
        print(f"\n{num_prompts} requests, {out_tokens} output tokens; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}\n")
        print("| weights | seconds | output tok/s | weights in memory |")
        print("|---|---:|---:|---:|", flush=True)
        for name, path, cached in [("float32 (safetensors)", base, False),
                                   ("GGUF Q8_0, dequantize per call (default)", files["Q8_0"], False),
                                   ("GGUF Q8_0, dequantized once (cached)", files["Q8_0"], True),
                                   ("GGUF Q4_K, dequantize per call (default)", files["Q4_K"], False),
                                   ("GGUF Q4_K, dequantized once (cached)", files["Q4_K"], True)]:
            seconds, weights = run(path, requests, max_model_len, cached, tokenizer=str(base), dtype="float32")
            print(f"| {name} | {seconds:.1f} | {out_tokens / seconds:.1f} | {weights / 2**20:.1f} MiB |", flush=True)


def forward_rows() -> None:
    from engine.bench.quant import forward_times
    from engine.bench.random_model import BENCH_LLAMA, make_random_llama
    with tempfile.TemporaryDirectory() as tmp:
        base = make_random_llama(Path(tmp) / "float")
        q8, q4 = (write_gguf_llama(Path(tmp) / f"bench-{t}.gguf", t, BENCH_LLAMA) for t in ("Q8_0", "Q4_K"))
        forward_times([("float32", base, False), ("Q8_0 per call", q8, False), ("Q8_0 cached", q8, True),
                       ("Q4_K per call", q4, False), ("Q4_K cached", q4, True)], (1, 8, 32, 256), 15)


def load_rows(gib: float) -> None:
    """An engine start from a `gib` GiB Q8_0 file against reading the file into memory once."""
    from engine import LLM
    from engine.bench.random_model import make_random_llama
    shape = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=32000, max_position_embeddings=4096)
    per_layer = _nbytes("Q8_0", 2 * 4096 + 2 * 1024, 4096) + 3 * _nbytes("Q8_0", 11008, 4096)
    layers = max(1, round((gib * 2**30 - 2 * _nbytes("Q8_0", 32000, 4096)) / per_layer))
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = make_random_llama(Path(tmp) / "tok", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=32000)
        start = time.perf_counter()
        path = write_gguf_llama(Path(tmp) / "big-Q8_0.gguf", "Q8_0", {**shape, "num_hidden_layers": layers})
        size = path.stat().st_size
        print(f"\nwrote {size / 2**30:.2f} GiB ({layers} layers) in {time.perf_counter() - start:.1f} s\n")
        print("| step | seconds | GiB/s |")
        print("|---|---:|---:|")
        start = time.perf_counter()
        data = path.read_bytes()
        seconds = time.perf_counter() - start
        del data
        print(f"| read the file into memory (read-and-copy, page cache warm) | {seconds:.2f} | "
              f"{size / 2**30 / seconds:.2f} |")
        start = time.perf_counter()
        llm = LLM(str(path), device="cpu", max_model_len=512, tokenizer=str(tokenizer), dtype="bfloat16")
        seconds = time.perf_counter() - start
        print(f"| engine start from the GGUF (mapped; each tensor's bytes copied once into its layer) | "
              f"{seconds:.2f} | {size / 2**30 / seconds:.2f} |", flush=True)
        llm.engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench gguf", description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--planner-only", action="store_true")
    parser.add_argument("--forward-only", action="store_true",
                        help="time model forwards (1 to 256 tokens) instead of serving requests")
    parser.add_argument("--load-gib", type=float, default=0.0,
                        help="time an engine start from a GGUF of this many GiB (and nothing else)")
    args = parser.parse_args(argv)
    if args.load_gib:
        load_rows(args.load_gib)
        return
    if args.forward_only:
        forward_rows()
    elif not args.planner_only:
        cpu_rows(args.num_prompts, args.max_model_len)
    planner_rows()


if __name__ == "__main__":
    main()
