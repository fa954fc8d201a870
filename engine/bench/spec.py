"""`pagedesk-bench spec`: decode tokens/s with and without speculative decoding, at batch 1 and batch 8,
and the acceptance of each method, on a repetitive workload (code being edited: the prompt repeats a block
with small edits) and a free-text one (random tokens).

The target is the bench's random-weight llama (or `--model`); the draft is a layer-skip copy of it (its
first `--draft-layers` layers with the target's embedding and head: a genuine cheaper model whose
proposals the target only partly agrees with), or `--draft FOLDER`; and the target as its own draft
(acceptance 100%: the bound on what a draft buys at this k). Random weights make the acceptance
figures a property of this random model (greedy random models fall into loops, which n-gram lookup
catches), not of real text: run it with a real target and draft (`--model`, `--draft`) on a card for
figures that mean something about a workload. Greedy; every run generates exactly `--output-len` tokens
per request (EOS ignored). On CPU the clock is the process's CPU time on one thread (`time.process_time`,
as `pagedesk-bench itl` does), so a shared, busy machine does not move the figures; `--clock wall` for an
idle machine. `--tensor-parallel-size 2` runs the target over two ranks (the draft whole on rank 0); the
CPU clock would count rank 0's process only, so it takes `--clock wall`. `--methods` picks a subset.
`--device cuda` (or `cuda:N`, `auto`) runs every engine on a card, with the wall clock (the CPU clock does not
see the card's work) and the engine's CUDA defaults (graphs, Triton kernels): the figures for BENCHMARKS.md.

`--family qwen3_5` makes the target a random hybrid Qwen3.5 instead (Gated DeltaNet layers, 3 of every 4, with
gated full attention; the shape of `pagedesk-bench hybrid --cpu`) with a random MTP head written under the
published names (engine/bench/mtp_heads.py), and its methods are off, ngram, "mtp" (the random head, which the
target rarely agrees with: rejected drafts roll the DeltaNet states back; the lower bound) and "mtp=exact": a
copy of the target made a bigram model (its layers' output projections zeroed, so they compute as much as
before) with a head that computes the target's next hidden state exactly, accepted on every draft: the upper
bound on what an MTP head buys at this k. Its "vs off" and "same output" are against speculation off on that
same copy, run beside it. With `--model`, `--family qwen3_5` benchmarks a real checkpoint's own MTP head
(methods off, ngram, mtp).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from engine.bench.mtp_heads import bigram_with_exact_head
from engine.bench.random_model import make_random_llama, make_random_model


def make_layer_skip_draft(target: Path, out: Path, num_layers: int) -> Path:
    """A draft made of the target's first `num_layers` layers, its embedding, final norm and head."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    for shard in sorted(target.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= num_layers:
                continue
            tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


def make_random_qwen3_5(path: Path) -> Path:
    """The bench's random hybrid Qwen3.5 (the shape `pagedesk-bench hybrid --cpu` serves) with a random MTP head."""
    from engine.bench.hybrid import CPU_LINEAR, CPU_SHAPE
    from engine.bench.mtp_heads import add_mtp_head

    make_random_model(path, "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {**CPU_SHAPE, **CPU_LINEAR})
    return add_mtp_head(path)


def workloads(vocab: int, prompt_len: int, batch: int, seed: int = 0) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    free = [[rng.randrange(4, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    code = []
    for _ in range(batch):  # a block of "code", then the block again with a few tokens edited
        block = [rng.randrange(4, vocab) for _ in range(prompt_len // 2)]
        edited = [t if rng.random() > 0.05 else rng.randrange(4, vocab) for t in block]
        code.append(block + edited[:prompt_len - len(block)])
    return {"repetitive": code, "free-text": free}


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def run(path: Path, prompts: list[list[int]], output_len: int, spec: dict | None, max_model_len: int,
        clock=time.process_time, tensor_parallel_size: int = 1, device: str = "cpu") -> dict:
    """Decode tokens/s: the clock from the last first token to the end (prefill excluded), per output."""
    from engine import LLM, SamplingParams

    llm = LLM(str(path), device=device, max_model_len=max_model_len, speculative_config=spec,
              enable_prefix_caching=False, tensor_parallel_size=tensor_parallel_size)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
    if llm.engine.spec is not None:
        llm.engine.spec.stats.__init__(llm.engine.spec.stats.num_speculative_tokens, llm.engine.spec.stats.method)
    # The prompts first (one step computes them all and samples each first token), then the decode alone.
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outs = {}
    first = True
    start = clock()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        if first:
            first, start = False, clock()
    decode_s = max(1e-9, clock() - start)
    ids = [outs[str(i)].outputs[0].token_ids for i in range(len(prompts))]
    assert all(len(t) == output_len for t in ids), [len(t) for t in ids]
    result = {"tok_s": (output_len - 1) * len(prompts) / decode_s, "ids": ids}
    if llm.engine.spec is not None:
        result["stats"] = llm.engine.spec.stats.as_dict()
    llm.engine.shutdown()
    return result


def row(workload: str, batch: int, method: str, r: dict, base: dict) -> str:
    stats = r.get("stats")
    acc = f"{100 * stats['acceptance_rate']:.0f}%" if stats else "-"
    mal = f"{stats['mean_acceptance_length']:.2f}" if stats else "-"
    return (f"| {workload} | {batch} | {method} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | "
            f"{acc} | {mal} | {'yes' if r['ids'] == base['ids'] else 'NO'} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pagedesk-bench spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=("llama", "qwen3_5"), default="llama",
                    help="the random target: a llama, or a hybrid Qwen3.5 with an MTP head (methods off, ngram, "
                         "mtp, mtp=exact)")
    ap.add_argument("--model", help="target folder (default: the family's random model; with --family qwen3_5 a "
                                    "checkpoint with MTP weights)")
    ap.add_argument("--draft", help="draft folder (default: a layer-skip copy of the target)")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default=None,
                    help="cpu (the default on CPU) or wall (the default, and the only choice, on a card)")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto (the engine's --device)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--methods", help="comma-separated subset of off, ngram, draft, draft=target, or for "
                    "--family qwen3_5 of off, ngram, mtp, mtp=exact (off first: the baseline; default: all)")
    args = ap.parse_args(argv)
    tp = args.tensor_parallel_size
    on_card = args.device != "cpu"
    if on_card and args.clock == "cpu":
        ap.error(f"--device {args.device} needs --clock wall: the CPU clock does not see the card's work")
    args.clock = args.clock or ("wall" if on_card else "cpu")
    if tp > 1 and args.clock == "cpu":
        ap.error("--tensor-parallel-size > 1 needs --clock wall: the CPU clock counts rank 0's process only")
    import torch
    if not on_card and (args.clock == "cpu" or tp > 1):
        # CPU time then counts work, not threads spinning while descheduled; under tensor parallel rank 0 runs
        # one thread like its workers (two threads per rank on a loaded box spin in barriers, not compute).
        torch.set_num_threads(1)
    hybrid = args.family == "qwen3_5"
    if hybrid and args.draft:
        ap.error("--family qwen3_5 speculates with the target's MTP head: drop --draft")
    k = args.num_speculative_tokens
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    known = ("off", "ngram", "mtp", "mtp=exact") if hybrid else ("off", "ngram", "draft", "draft=target")
    chosen = (args.methods or ",".join(known)).split(",")
    unknown = sorted(set(chosen) - set(known))
    if unknown or chosen[0] != "off":
        ap.error(f"--methods: {unknown or chosen} — pick from {list(known)}, \"off\" first")
    if hybrid and args.model and "mtp=exact" in chosen:
        ap.error("--methods mtp=exact is the random target's bigram copy: with --model pick off, ngram, mtp")
    tmp = Path(tempfile.mkdtemp(prefix="pagedesk-bench-spec-"))
    # method -> (target folder, speculative_config); a method on another target than "off"'s names its own
    # baseline run on that target.
    if hybrid:
        target = Path(args.model) if args.model else make_random_qwen3_5(tmp / "target")
        mtp = {"method": "mtp", "num_speculative_tokens": k}
        methods = {"off": (target, None), "ngram": (target, ngram), "mtp": (target, mtp)}
        if "mtp=exact" in chosen:
            exact = bigram_with_exact_head(target, tmp / "exact")
            methods["mtp=exact"] = (exact, mtp)
        described = f"target {target}" + ("" if args.model else " (random Qwen3.5 with a random MTP head)")
    else:
        target = Path(args.model) if args.model else make_random_llama(tmp / "target")
        draft = Path(args.draft) if args.draft else make_layer_skip_draft(target, tmp / "draft", args.draft_layers)
        methods = {"off": (target, None), "ngram": (target, ngram),
                   "draft": (target, {"model": str(draft), "num_speculative_tokens": k}),
                   # The target as its own draft: every draft accepted, at the price of a second target per
                   # token; the bound on what a draft buys at this k, and what verifying costs.
                   "draft=target": (target, {"model": str(target), "num_speculative_tokens": k})}
        described = f"target {target}, draft {draft} ({args.draft_layers} layers)"
    methods = {m: methods[m] for m in chosen}
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    max_len = args.prompt_len + args.output_len + 16
    print(f"{described}, k={k}, prompt {args.prompt_len}, "
          f"output {args.output_len} tokens, greedy, device {args.device}, {args.clock} clock, "
          f"tensor_parallel_size {tp}")
    print("| workload | batch | method | decode tok/s | vs off | acceptance | mean accepted length | same output |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for name, prompts in workloads(vocab, args.prompt_len, batch).items():
            bases = {}
            for method, (path, spec) in methods.items():
                if path not in bases and method != "off":  # speculation off on this method's own target
                    bases[path] = run(path, prompts, args.output_len, None, max_len, CLOCKS[args.clock], tp,
                                      args.device)
                    print(row(name, batch, f"off ({method}'s target)", bases[path], bases[path]), flush=True)
                r = run(path, prompts, args.output_len, spec, max_len, CLOCKS[args.clock], tp, args.device)
                print(row(name, batch, method, r, bases.setdefault(path, r)), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
