"""`pagedesk-bench quant`: quantized vs float weights on CPU, and the planner's verdicts for 4-bit models.

The bench Llama (engine/bench/random_model.py) is written three ways — float32, GPTQ 4-bit group 128 (random
codes, symmetric, v1 zero convention) and FP8 per-channel — and each serves the same ShareGPT-like
requests. The GPTQ engine runs twice: as shipped (weights stay packed, each linear dequantizes its matrix on
every call) and with every layer's dequantized matrix cached once (float memory again), to show what
per-call dequantization costs; `--forward-only` times single model forwards instead, interleaving the
configurations so that other load on the machine hits them alike. Then the capacity planner's verdicts
for Qwen2.5-32B-Instruct-AWQ on one 24 GB card and Llama-3.3-70B-Instruct-AWQ on two, from their
published configs (literal dicts).
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from engine.bench.random_model import make_random_llama
from engine.bench.workload import sharegpt_like

AWQ_G128 = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
            "zero_point": True}
PUBLISHED = {
    "Qwen2.5-32B-Instruct-AWQ": ({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 5120, "intermediate_size": 27648,
        "num_attention_heads": 40, "num_hidden_layers": 64, "num_key_value_heads": 8, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "torch_dtype": "float16", "quantization_config": AWQ_G128}, 1),
    "Llama-3.3-70B-Instruct-AWQ": ({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
        "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "torch_dtype": "float16", "quantization_config": AWQ_G128}, 2),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_quantized(src: Path, dst: Path, method: str) -> Path:
    """A copy of `src` whose decoder linears are random GPTQ 4-bit g128 codes, or FP8 casts of the weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kernels.quant_torch import pack_int32
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"} if method == "fp8" else \
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    (dst / "config.json").write_text(json.dumps(config))
    out = {}
    gen = torch.Generator().manual_seed(0)
    for name, t in load_file(str(dst / "model.safetensors")).items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS):
            out[name] = t
        elif method == "fp8":
            scale = t.abs().amax(1).clamp(min=1e-6) / 448.0
            out[name], out[f"{module}.weight_scale"] = (t / scale[:, None]).to(torch.float8_e4m3fn), scale
        else:
            n, k = t.shape
            out[f"{module}.qweight"] = pack_int32(torch.randint(0, 16, (k, n), generator=gen), 4, dim=0)
            out[f"{module}.qzeros"] = pack_int32(torch.full((k // 128, n), 7), 4, dim=1)  # v1: zero 8 stored as 7
            out[f"{module}.scales"] = (t.std() / 4 * torch.ones(k // 128, n)).half()
            out[f"{module}.g_idx"] = (torch.arange(k) // 128).int()
    save_file(out, str(dst / "model.safetensors"))
    return dst


def cache_dequantized(model: torch.nn.Module) -> int:
    """Every quantized linear's matrix dequantized once, as --cpu-dequant-cache keeps them; bytes added."""
    from engine.layers.linear import keep_dequantized
    return keep_dequantized(model, float("inf"), torch.float32)


def run(path: Path, requests, max_model_len: int, cached: bool = False, **engine_args) -> tuple[float, int]:
    from engine import LLM, SamplingParams
    llm = LLM(str(path), device="cpu", max_model_len=max_model_len, **engine_args)
    added = cache_dequantized(llm.engine.runner.model) if cached else 0
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    weights = llm.engine.runner.weights_bytes() + added
    llm.engine.shutdown()
    return elapsed, weights


def forward_times(configs: list[tuple[str, Path, bool]], token_counts: tuple[int, ...], reps: int) -> None:
    """Median ms of one model forward (linears, norms, rope; no attention) per config, interleaved so that
    other load on the machine hits every config alike (a config's path may be a GGUF file)."""
    import statistics

    from engine.config.gguf_file import is_gguf
    from engine.config.model import ModelConfig
    from engine.worker.gguf_loader import iterate_gguf_weights
    from engine.worker.loader import iterate_weights
    from engine.models.registry import model_class

    models = []
    for _, path, cached in configs:
        cfg = ModelConfig.from_folder(path)
        model = model_class(cfg.architecture)(cfg).eval()
        model.load_weights(iterate_gguf_weights(path, model) if is_gguf(path) else iterate_weights(path))
        if cached:
            cache_dequantized(model)
        models.append(model)
    print("\n| tokens per forward | " + " | ".join(f"{name} ms" for name, _, _ in configs) + " |")
    print("|---:|" + "---:|" * len(configs))
    for tokens in token_counts:
        ids, positions = torch.randint(10, 8000, (tokens,)), torch.arange(tokens)
        samples = [[] for _ in models]
        with torch.inference_mode():
            for rep in range(reps + 1):
                for i, model in enumerate(models):
                    start = time.perf_counter()
                    model(ids, positions, None)
                    if rep:  # the first round warms up
                        samples[i].append((time.perf_counter() - start) * 1e3)
        print(f"| {tokens} | " + " | ".join(f"{statistics.median(s):.1f}" for s in samples) + " |", flush=True)


def planner_verdicts() -> None:
    from engine.config.model import ModelConfig
    from engine.planning.planner import plan_capacity
    from engine.planning.units import GIB
    print("\n| model | cards | weights/card | KV tokens that fit | verdict at the model's context |")
    print("|---|---|---:|---:|---|")
    for name, (hf, tp) in PUBLISHED.items():
        cfg = ModelConfig.from_hf_config(hf)
        plan = plan_capacity(cfg, [24 * GIB] * tp, 0.9, dtype="float16", tensor_parallel_size=tp)
        verdict = f"fits {plan.num_full_seqs} × {plan.max_model_len:,}" if plan.fits else \
            f"does not fit one {plan.max_model_len:,}-token sequence"
        print(f"| {name} ({cfg.quantization.describe()}) | {tp} × 24 GiB, 0.9 | {plan.weights_bytes / GIB:.2f} GiB | "
              f"{plan.num_tokens:,} | {verdict} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench quant", description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--planner-only", action="store_true")
    parser.add_argument("--forward-only", action="store_true",
                        help="time model forwards (8 and 256 tokens) instead of serving requests")
    args = parser.parse_args(argv)
    if args.forward_only:
        with tempfile.TemporaryDirectory() as tmp:
            base = make_random_llama(Path(tmp) / "float")
            gptq, fp8 = (write_quantized(base, Path(tmp) / m, m) for m in ("gptq", "fp8"))
            forward_times([("float32", base, False), ("GPTQ 4-bit per call", gptq, False),
                           ("GPTQ 4-bit cached", gptq, True), ("FP8 per call", fp8, False)], (1, 8, 32, 256), 15)
    elif not args.planner_only:
        with tempfile.TemporaryDirectory() as tmp:
            base = make_random_llama(Path(tmp) / "float")
            requests = sharegpt_like(args.num_prompts, 8192, args.max_model_len, 0)
            out_tokens = sum(r.output_len for r in requests)
            gptq, fp8 = (write_quantized(base, Path(tmp) / m, m) for m in ("gptq", "fp8"))
            print(f"\n{args.num_prompts} requests, {out_tokens} output tokens; torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}\n")
            print("| weights | seconds | output tok/s | weights in memory |")
            print("|---|---:|---:|---:|", flush=True)
            for name, path, cached in [("float32", base, False),
                                       ("GPTQ 4-bit g128, dequantize per call (default)", gptq, False),
                                       ("GPTQ 4-bit g128, dequantized once (cached)", gptq, True),
                                       ("FP8 per-channel, dequantize per call (default)", fp8, False)]:
                seconds, weights = run(path, requests, args.max_model_len, cached)
                print(f"| {name} | {seconds:.1f} | {out_tokens / seconds:.1f} | {weights / 2**20:.1f} MiB |",
                      flush=True)
    planner_verdicts()


if __name__ == "__main__":
    main()
