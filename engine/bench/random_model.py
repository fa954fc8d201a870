"""The benchmark model: a random-weight folder of any transformers architecture, written on the fly.

The benchmarks' Llama shape (`BENCH_LLAMA`: hidden 512, 8 layers), or any other family's config and shape;
float32 weights and a word-level tokenizer, so nothing is downloaded. Needs torch and transformers (imported
when a folder is written); the request mix beside it (workload.py) stays torch-free.
"""
from __future__ import annotations

from pathlib import Path

BENCH_LLAMA = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=1536, vocab_size=8192, max_position_embeddings=2048)
# The peer bench's tiny model (`pagedesk-bench peer`, `steps`): the same shape with 2 layers, where the host's
# work per step weighs most; PEER_WIDE is one whose matmuls dominate (hidden 1024).
PEER_LLAMA = dict(num_hidden_layers=2)
PEER_WIDE = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=3072)


def make_random_llama(path: Path, seed: int = 0, byte_fallback: bool = False, **overrides) -> Path:
    """Write a random-weight LlamaForCausalLM folder (bf16-free float32 weights) with a word-level tokenizer, or with
    `byte_fallback` a Llama-2-style one that llama.cpp's converter reads (the peer bench)."""
    return make_random_model(path, "LlamaConfig", "LlamaForCausalLM", {**BENCH_LLAMA, **overrides}, seed,
                             byte_fallback)


def make_random_model(path: Path, config_name: str, model_name: str, shape: dict, seed: int = 0,
                      byte_fallback: bool = False) -> Path:
    """Write a random-weight folder of any transformers architecture, float32, with a word-level tokenizer (or a
    byte-fallback BPE one, see `make_random_llama`)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = getattr(transformers, config_name)(**shape, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                                dtype="float32")
    config.architectures = [model_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    special = {"<s>": 0, "</s>": 1, "<pad>": 2, "<unk>": 3}
    if byte_fallback:  # Llama 2's layout: "▁" word pieces, <0xNN> bytes for the rest, no merges (ids are sent)
        vocab = special | {f"<0x{b:02X}>": 4 + b for b in range(256)}
        vocab |= {f"\u2581w{i}": i for i in range(len(vocab), shape["vocab_size"])}
        tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        vocab = special | {f"w{i}": i for i in range(4, shape["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    return path
