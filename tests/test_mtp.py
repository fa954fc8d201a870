"""Speculative method "mtp": the multi-token-prediction head of Qwen3.5 / Qwen3-Next checkpoints.

Tiny hybrid checkpoints get an MTP head written on the fly under the published names (mtp.fc,
mtp.pre_fc_norm_embedding / _hidden, mtp.layers.0.* as a full-attention decoder layer, mtp.norm). The head
loads every one of them; its drafts, made incrementally over the paged KV (prompt chunks, a verify run with a
rejected tail), equal a from-scratch torch reference of the published structure whose decoder layer is HF's
own full-attention layer holding the MTP weights. End to end, greedy output with MTP speculation is the
output without it (a random head, drafts rejected: the DeltaNet states roll back), the drafts the engine
verified are the reference's, and a head that computes the target's next hidden state exactly is accepted on
every draft. Configuration errors name the field (exit 2 from pagedesk-serve).
"""
from __future__ import annotations

import copy
import functools
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.bench.mtp_heads import add_mtp_head, bigram_with_exact_head
from engine.worker.model_runner import ModelRunner
from engine.config.model import ModelConfig
from engine.entrypoints.serve import main as serve_main
from engine.planning.speculation import mtp_footprint
from engine.config.speculative import parse_speculative_config
from engine.distributed.parallel_state import init_tensor_parallel
from engine.spec_decode.loading import check_mtp, load_mtp
from hf_reference import make_prompts
from tiny_models import hf_model

pytestmark = pytest.mark.timeout(300)
BLOCK = 4


@pytest.fixture(scope="module")
def mtp_dir(tiny_model_dir, tmp_path_factory):
    """The session's tiny hybrid checkpoint, copied, with an MTP head added."""
    @functools.cache
    def get(arch):
        path = tmp_path_factory.mktemp(arch) / "with-mtp"
        shutil.copytree(tiny_model_dir(arch), path)
        add_mtp_head(path, reference_layer=path.parent / "mtp_layer_reference.pt")
        return path
    return get


def gemma_norm(x, w, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())


class Reference:
    """The published structure in plain torch around HF's own decoder layer (loaded with the mtp.layers.0
    tensors), recomputed from scratch over whole sequences."""

    def __init__(self, path):
        from safetensors.torch import load_file
        self.hf = hf_model(path)
        cfg = self.hf.config
        self.eps, self.mrope = cfg.rms_norm_eps, cfg.model_type.startswith("qwen3_5")
        self._known: list[tuple[list[int], torch.Tensor]] = []
        mtp = load_file(str(path / "mtp.safetensors"))
        self.w = {k[4:]: v for k, v in mtp.items() if not k.startswith("mtp.layers.")}
        self.layer = copy.deepcopy(self.hf.model.layers[cfg.layer_types.index("full_attention")])
        self.layer.load_state_dict(torch.load(path.parent / "mtp_layer_reference.pt"))

    def target_hidden(self, tokens):
        """HF's hidden states over `tokens` (each row sees only the tokens up to it: a longer sequence computed
        before serves its prefixes, which keeps HF's slow reference DeltaNet path to a few calls)."""
        for known, hidden in self._known:
            if known[:len(tokens)] == list(tokens):
                return hidden[:len(tokens)]
        with torch.no_grad():
            hidden = self.hf.model(torch.tensor([tokens])).last_hidden_state[0]
        self._known.append((list(tokens), hidden))
        return hidden

    @torch.no_grad()
    def head(self, ids, hidden):
        """The head over positions 0..T-1: row p embeds ids[p] (the token after p) with hidden[p]."""
        embed = self.hf.model.embed_tokens(torch.tensor([ids]))[0]
        x = torch.cat([gemma_norm(embed, self.w["pre_fc_norm_embedding.weight"], self.eps),
                       gemma_norm(hidden, self.w["pre_fc_norm_hidden.weight"], self.eps)], dim=-1)
        x = (x @ self.w["fc.weight"].T)[None]
        t = x.shape[1]
        pos = torch.arange(t)[None]
        rope = self.hf.model.rotary_emb(x, pos.expand(3, 1, t) if self.mrope else pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = self.layer(x, position_embeddings=rope, attention_mask=mask, position_ids=pos)
        x = x[0] if isinstance(x, tuple) else x
        return gemma_norm(x[0], self.w["norm.weight"], self.eps)

    def drafts(self, tokens, k):
        """k greedy drafts after `tokens`: the head over every position, then applied again on its own output."""
        target = self.target_hidden(tokens[:-1])
        ids, hidden, out = list(tokens[1:]), target, []
        for _ in range(k):
            h = self.head(ids, hidden)
            out.append(int(self.hf.lm_head(h[-1]).argmax()))
            ids, hidden = ids + [out[-1]], torch.cat([hidden, h[-1:]])
        return out


def fake_seq(seq_id, tokens, computed, blocks):
    return SimpleNamespace(seq_id=seq_id, token_ids=list(tokens), num_computed_tokens=computed,
                           num_tokens=len(tokens), is_finished=False, request=SimpleNamespace(beam=None),
                           block_tables=[[SimpleNamespace(block_id=b) for b in blocks]])


def grow(seq, tokens):
    seq.token_ids += tokens
    seq.num_tokens = len(seq.token_ids)


def test_head_loads_the_published_names_and_drafts_like_the_reference(mtp_dir):
    path = mtp_dir("qwen3_5")
    cfg = ModelConfig.from_folder(path)
    spec = parse_speculative_config({"method": "mtp", "num_speculative_tokens": 3})
    layers = check_mtp(spec, SimpleNamespace(tensor_parallel_size=1), cfg, path)
    assert layers == 1
    runner = ModelRunner(cfg, path, torch.device("cpu"), torch.float32, BLOCK, "torch")
    mtp = load_mtp(layers, runner, path, "torch")  # every mtp.* tensor loaded exactly once, or it raises
    assert runner.keep_hidden and mtp.kv_bytes_per_block(4) == 2 * BLOCK * cfg.num_kv_heads * cfg.head_dim * 4
    weights, page = mtp_footprint(cfg, 4, 4, BLOCK)  # the planner's estimate of the same head
    assert page == mtp.kv_bytes_per_block(4) and abs(weights - mtp.weights_bytes()) <= 0.05 * mtp.weights_bytes()
    from engine.planning.planner import plan_cpu
    planned = plan_cpu(cfg, 0.01, block_size=BLOCK, mtp=True, num_speculative_tokens=3)
    assert planned.draft_weights_bytes == weights and planned.draft_kv_bytes_per_block == page
    from safetensors.torch import load_file
    assert mtp.weights_bytes() == sum(t.nbytes for t in load_file(str(path / "mtp.safetensors")).values())
    mtp.allocate_kv_cache(32, torch.float32)
    ref = Reference(path)
    vocab = cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(5, vocab, (n,), generator=g).tolist()  # noqa: E731
    a_tokens = rand(12)
    ref.target_hidden(a_tokens)
    a = fake_seq(1, a_tokens[:11], 0, [0, 1, 2, 3])  # a prompt in two chunks
    b = fake_seq(2, rand(9), 0, [4, 5, 6, 7])  # a prompt computed whole, its first token sampled

    def step(entries):
        """One target step: each (seq, start, positions computed) -> hidden rows as the runner keeps them."""
        rows, starts, row = [], [], 0
        for seq, start, n in entries:
            rows.append(ref.target_hidden(seq.token_ids)[start:start + n])
            starts.append((seq, start, row))
            row += n
        runner.last_hidden = torch.cat(rows)
        return starts

    starts = step([(a, 0, 6), (b, 0, 9)])
    a.num_computed_tokens = 6
    grow(b, rand(1))
    b.num_computed_tokens = 9
    mtp.catch_up(starts)
    assert mtp.draft_for(a) is None  # still prefilling
    want_b = ref.drafts(b.token_ids, 3)
    assert mtp.draft_for(b) == want_b[0]
    assert mtp.propose([(b, 3)]) == [want_b]
    # Next step: a finishes its prompt and samples; b verifies its 3 drafts and keeps 1 plus a bonus token (the
    # target's rows past it are for the rejected drafts).
    verify = b.token_ids + want_b
    starts = step([(a, 6, 5), (fake_seq(0, verify, 0, []), 9, 4)])
    starts[1] = (b, 9, starts[1][2])
    grow(a, a_tokens[11:])
    a.num_computed_tokens = 11
    grow(b, [want_b[0]] + rand(1))
    b.num_computed_tokens = 11
    mtp.catch_up(starts)  # b's positions 9, 10 rewritten over what its drafts had put there
    for seq in (a, b):
        want = ref.drafts(seq.token_ids, 2)
        assert mtp.draft_for(seq) == want[0]
        assert mtp.propose([(seq, 2)]) == [want]
    # The head's hidden state itself, not only its argmax, matches the reference at the last position.
    h_ref = ref.head(b.token_ids[1:], ref.target_hidden(b.token_ids[:-1]))[-1]
    torch.testing.assert_close(mtp.pending[b.seq_id].hidden, h_ref, atol=1e-4, rtol=1e-4)


def test_config_and_missing_weights_name_the_field(tiny_model_dir, mtp_dir, tmp_path, capsys):
    assert parse_speculative_config({"method": "mtp", "num_speculative_tokens": 2}).method == "mtp"
    with pytest.raises(ValueError, match="speculative_config.model"):
        parse_speculative_config({"method": "mtp", "num_speculative_tokens": 2, "model": "x/y"})
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config.method.*no MTP weights"):
        LLM(str(tiny_model_dir("qwen3_5")), device="cpu", speculative_config=spec)
    with pytest.raises(ValueError, match="speculative_config.method.*LlamaForCausalLM has no multi-token"):
        LLM(str(tiny_model_dir("llama")), device="cpu", speculative_config=spec)
    cfg = ModelConfig.from_folder(mtp_dir("qwen3_5"))  # tensor parallel is no reason to refuse (test below)
    assert check_mtp(parse_speculative_config(spec), SimpleNamespace(tensor_parallel_size=2), cfg,
                     mtp_dir("qwen3_5")) == 1
    code = serve_main(["--model", str(tiny_model_dir("qwen3_5")), "--device", "cpu",
                       "--speculative-config", json.dumps(spec)])
    assert code == 2 and "no MTP weights" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next", "qwen3_5-vl"])
def test_other_heads_load(mtp_dir, arch):
    """Qwen3.5-MoE's and Qwen3-Next's heads: the same names, the MTP layer a routed-expert block with a gated
    shared expert like the target's layer 0; a Qwen3.5 VL checkpoint's (Qwen3.6-27B's kind) beside its
    language model. None of the target's parameters is the head's own."""
    path = mtp_dir(arch)
    cfg = ModelConfig.from_folder(path)
    runner = ModelRunner(cfg, path, torch.device("cpu"), torch.float32, BLOCK, "torch")
    mtp = load_mtp(check_mtp(parse_speculative_config({"method": "mtp", "num_speculative_tokens": 1}),
                             SimpleNamespace(tensor_parallel_size=1), cfg, path), runner, path, "torch")
    assert type(mtp.head.layers[0].mlp).__name__ == ("LlamaMLP" if arch == "qwen3_5-vl" else "SparseMoeBlock")
    weights, page = mtp_footprint(cfg, 4, 4, BLOCK)  # the planner's estimate of the same head
    assert page == mtp.kv_bytes_per_block(4) and abs(weights - mtp.weights_bytes()) <= 0.05 * mtp.weights_bytes()
    assert not any(name.startswith(("model.", "lm_head")) for name, _ in mtp.head.named_parameters())


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_head_loads_whole_on_rank_0_of_a_group(mtp_dir, arch):
    """Under tensor parallel the head is whole on rank 0, built and loaded as one rank: every tensor equals the
    one-rank load's, its full vocabulary copies equal the one-rank target's. (Loaded while the group's size 2
    was in effect, its stacked gate/up projection took rank 0's halves of gate and up and left a half unwritten,
    uninitialized memory: when that held NaN every draft was wrong, and test_mtp_under_tensor_parallel_2
    accepted nothing about one run in three.) Rank 0 of a 2-rank group without torch.distributed: building and
    loading make no collective."""
    path = mtp_dir(arch)
    cfg = ModelConfig.from_folder(path)

    def load(tp):
        init_tensor_parallel(0, tp)
        try:
            runner = ModelRunner(cfg, path, torch.device("cpu"), torch.float32, BLOCK, "torch")
            return runner, load_mtp(1, runner, path, "torch")
        finally:
            init_tensor_parallel(0, 1)

    (one, whole), (_, rank0) = load(1), load(2)
    assert whole.head.vocab is None and rank0.head.vocab is not None
    want, got = whole.head.state_dict(), rank0.head.state_dict()
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert torch.equal(rank0.head.vocab.model.embed_tokens.weight, one.model.model.embed_tokens.weight)
    assert torch.equal(rank0.head.vocab.lm_head.weight, one.model.lm_head.weight)


def greedy_ids(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_with_mtp_is_identical_to_no_speculation(mtp_dir):
    """A random head on the random hybrid: its drafts are rejected, so the target's DeltaNet states roll back
    past them step after step, while prompts arrive in 16-token chunks sharing steps with verify runs."""
    path = mtp_dir("qwen3_5")
    prompts = [make_prompts(400)[i] for i in (1, 3, 4)]
    max_tokens = [6, 8, 6]
    want = greedy_ids(LLM(str(path), device="cpu"), prompts, max_tokens)
    llm = LLM(str(path), device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              max_num_batched_tokens=16)
    assert greedy_ids(llm, prompts, max_tokens) == want
    stats, kv = llm.engine.spec.stats, llm.engine.kv
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_drafts  # k = 2 drafts were verified
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and not llm.engine.spec.proposer.pending
    # The drafts the engine verified, made from the runner's kept hidden states over a chunked prompt and
    # verify steps, are the reference's drafts from HF's hidden states over the same tokens.
    engine = llm.engine
    engine.add_request("probe", make_prompts(400, seed=9)[4], SamplingParams(temperature=0, max_tokens=7))
    seq, verified = engine.requests["probe"].seqs[0], []
    while engine.has_unfinished_requests():
        before = list(seq.token_ids)
        engine.step()
        if seq.spec_token_ids:
            verified.append((before, list(seq.spec_token_ids)))
    ref = Reference(path)
    ref.target_hidden(seq.token_ids)  # once, over the longest sequence: every prefix reads it
    assert len(verified) >= 2
    assert [drafts for _, drafts in verified] == [ref.drafts(before, len(d)) for before, d in verified]


def bigram_chain(path, prompts, n) -> list[list[int]]:
    """The bigram model's greedy continuation, next = argmax(lm_head(norm(embed(last)))), from the checkpoint."""
    from safetensors.torch import load_file
    w = load_file(str(path / "model.safetensors"))
    eps = json.loads((path / "config.json").read_text())["rms_norm_eps"]
    want = []
    for prompt in prompts:
        out = [prompt[-1]]
        for _ in range(n):
            h = gemma_norm(w["model.embed_tokens.weight"][out[-1]], w["model.norm.weight"], eps)
            out.append(int((w["lm_head.weight"] @ h).argmax()))
        want.append(out[1:])
    return want


def test_an_exact_head_is_accepted(tiny_model_dir, tmp_path):
    """A head that computes the target's next hidden state exactly: greedy drafts are the target's tokens, so
    (nearly) every draft is accepted, at every position, and the output is still the target's — here a bigram
    chain, next = argmax(lm_head(norm(embed(last)))), computed straight from the checkpoint."""
    path = bigram_with_exact_head(tiny_model_dir("qwen3_5"), tmp_path / "bigram")
    prompts = [make_prompts(400, seed=5)[i] for i in (2, 4)]
    want = bigram_chain(path, prompts, 12)
    llm = LLM(str(path), device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert greedy_ids(llm, prompts, [12, 12]) == want
    stats = llm.engine.spec.stats
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
    assert min(stats.accepted_per_pos) > 0 and stats.mean_acceptance_length > 3


def test_mtp_under_tensor_parallel_2(tiny_model_dir, tmp_path):
    """TP=2 over gloo: the head runs whole on rank 0 on rank 0's copy of the target's last hidden states, with its
    own full embedding and LM head (the target's are vocab shards). The exact head's drafts are the target's own
    tokens only if those full copies and the hidden states are right, so the plain requests accept nearly all;
    a penalised request (the head knows no penalties) rejects some, so the hybrid's states roll back under TP
    too. Outputs: the bigram chain computed from the checkpoint, and the engine's without speculation."""
    import torch.distributed as dist
    path = bigram_with_exact_head(tiny_model_dir("qwen3_5"), tmp_path / "bigram")
    prompts = [make_prompts(400, seed=5)[i] for i in (1, 3, 3)]
    params = [SamplingParams(temperature=0, max_tokens=10), SamplingParams(temperature=0, max_tokens=7),
              SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.5, presence_penalty=0.5)]
    chain = bigram_chain(path, prompts[:2], 10)
    # No speculation (one rank: cheaper to start than a second TP=2 group, and TP=2 equals it, tests/
    # test_spec_decode_hybrid.py::test_ngram_under_tensor_parallel_2).
    want = [o.outputs[0].token_ids for o in LLM(str(path), device="cpu").generate(prompts, params, use_tqdm=False)]
    assert want[:2] == [chain[0], chain[1][:7]] and want[2] != chain[1]
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        stats, mtp = llm.engine.spec.stats, llm.engine.spec.proposer
        assert 0.5 * stats.num_draft_tokens <= stats.num_accepted_tokens < stats.num_draft_tokens
        assert stats.num_draft_tokens > stats.num_drafts > 0 and stats.mean_acceptance_length > 2
        # Its own full vocabulary tensors (untied here: two), counted by the planner's footprint at TP=2.
        cfg = ModelConfig.from_folder(path)
        vocab_bytes = 2 * cfg.vocab_size * cfg.hidden_size * 4
        assert mtp.head.vocab.weights_bytes() == vocab_bytes
        assert mtp.head.vocab.model.embed_tokens.weight.shape[0] == cfg.vocab_size
        weights, page = mtp_footprint(cfg, 4, 4, mtp.block_size, tensor_parallel_size=2)
        assert weights - mtp_footprint(cfg, 4, 4, mtp.block_size)[0] == vocab_bytes
        assert page == mtp.kv_bytes_per_block(4)
        assert abs(weights - mtp.weights_bytes()) <= 0.05 * mtp.weights_bytes()
        from engine.planning.planner import plan_capacity
        from engine.planning.units import GIB
        planned = plan_capacity(cfg, [GIB] * 2, 0.9, dtype="float32", tensor_parallel_size=2, mtp=True,
                                block_size=mtp.block_size, num_speculative_tokens=3)
        assert planned.draft_weights_bytes == weights  # the planner counts the copies on the first card
        assert not mtp.pending and llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5-vl"])
def test_full_vocab_copy_reads_the_targets_names(tiny_model_dir, arch):
    """The full embedding / LM head copy the head takes under tensor parallel, read through the target's weights
    mapper: a tied one (Qwen2) is one tensor, a VL checkpoint's sits under its language model's names; both
    equal the target's own (loaded at one rank, unsharded)."""
    from engine.models.qwen3_next_mtp import FullVocab
    from engine.spec_decode.loading import load_full_vocab
    path = tiny_model_dir(arch)
    cfg = ModelConfig.from_folder(path)
    target = ModelRunner(cfg, path, torch.device("cpu"), torch.float32, BLOCK, "torch").model
    vocab = FullVocab(cfg)
    load_full_vocab(vocab, path, target.weights_mapper)  # every tensor it expects, or it raises
    copies = 1 if cfg.tie_word_embeddings else 2
    assert copies == (1 if arch == "qwen2" else 2)
    assert vocab.weights_bytes() == copies * cfg.vocab_size * cfg.hidden_size * 4
    ids = torch.tensor([1, 7, cfg.vocab_size - 1])
    torch.testing.assert_close(vocab.model.embed_tokens(ids), target.model.embed_tokens(ids))
    hidden = torch.randn(2, cfg.hidden_size)
    torch.testing.assert_close(vocab.compute_logits(hidden), target.compute_logits(hidden))
