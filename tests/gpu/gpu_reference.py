"""Teacher-forced agreement with HF transformers on the GPU: for every generated token, does HF's argmax,
given the same prefix, pick the same token? Divergences do not cascade, so a near-tie costs one token, and
the first disagreement is described (with HF's top-2 margin) for the report. A token whose HF logit is
within HF's own rounding of the maximum (one ulp of the dtype: random tiny models in bf16 have such
near-ties every hundred tokens or so) counts as agreement: HF cannot tell the two apart either."""
from __future__ import annotations

import torch


def greedy_tokens(llm, prompts, max_tokens) -> list[list[int]]:
    from engine import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@torch.inference_mode()
def hf_agreement(path, prompts, outputs, dtype: torch.dtype, device: str = "cuda") -> tuple[float, str]:
    """(fraction of generated tokens HF also picks, a sentence about the first disagreement or "none")."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    same = total = 0
    first = "none"
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ids = torch.tensor([prompt + out], device=device)
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        predicted = logits.argmax(-1).tolist()
        for j, (ours, theirs) in enumerate(zip(out, predicted)):
            total += 1
            rounding = torch.finfo(dtype).eps * abs(float(logits[j, theirs]))
            agrees = ours == theirs or float(logits[j, theirs] - logits[j, ours]) <= rounding
            same += agrees
            if not agrees and first == "none":
                top2 = logits[j].topk(2).values
                first = (f"prompt {i}, token {j}: ours {ours}, HF {theirs} (HF top-2 margin "
                         f"{float(top2[0] - top2[1]):.3g}, our token's logit gap {float(top2[0] - logits[j, ours]):.3g})")
    del model
    return same / max(1, total), first
