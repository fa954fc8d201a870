"""Gated DeltaNet kernel microbenchmark: ms per call of one layer's conv1d + gated delta rule, prefill and
decode, for the torch reference, our Triton kernels and (when installed) fla's. `python -m
kernels.bench_gated_delta --device cuda` uses Qwen3.6-27B's DeltaNet shapes (16 key heads, 48 value heads,
head dims 128, conv width 4; `--tp 2` halves the heads as one rank holds them); `--device cpu` times the
torch reference at tiny-to-medium shapes. Prints a markdown table for BENCHMARKS.md; nothing is asserted.

fla is timed through its public API, which takes and returns the state as a batch tensor: its decode time
includes the gather of the slots' states and the scatter back that our kernels avoid (their state stays in
the pool). fla's causal conv is not timed (it needs the separate causal-conv1d package).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import gated_delta_torch
from kernels.bench_timing import markdown_table, median_ms


@dataclass(frozen=True)
class Shapes:
    key_heads: int
    value_heads: int
    head_dim: int
    conv_width: int = 4

    @property
    def conv_dim(self) -> int:
        return (2 * self.key_heads + self.value_heads) * self.head_dim


QWEN36_27B = Shapes(16, 48, 128)
CPU_SHAPES = [Shapes(2, 4, 32), Shapes(4, 8, 64), Shapes(16, 48, 128)]


def make_batch(shapes: Shapes, lengths: list[int], dtype: torch.dtype, device: str, slots: int):
    """Random layer inputs for sequences of `lengths`, each continuing from a random state in a pool."""
    total, hk, hv, d = sum(lengths), shapes.key_heads, shapes.value_heads, shapes.head_dim
    mixed = torch.randn(total, shapes.conv_dim, dtype=dtype, device=device)
    return dict(
        mixed=mixed, conv_weight=torch.randn(shapes.conv_dim, shapes.conv_width, dtype=dtype, device=device) * 0.3,
        conv_states=torch.randn(slots, shapes.conv_dim, shapes.conv_width - 1, dtype=dtype, device=device),
        ssm_states=torch.randn(slots, hv, d, d, dtype=torch.float32, device=device) * 0.1,
        g=-F.softplus(torch.randn(total, hv, device=device)) * 0.3,
        beta=torch.rand(total, hv, device=device).to(dtype),
        state_indices=torch.randperm(slots, device=device)[:len(lengths)].to(torch.int32),
        query_start_loc=torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                                     device=device),
        has_initial_state=torch.ones(len(lengths), dtype=torch.bool, device=device), shapes=shapes)


def split_qkv(x: torch.Tensor, shapes: Shapes):
    hk, hv, d = shapes.key_heads, shapes.value_heads, shapes.head_dim
    q, k, v = x.split([hk * d, hk * d, hv * d], dim=-1)
    return q.view(-1, hk, d), k.view(-1, hk, d), v.view(-1, hv, d)


def layer_call(module, batch):
    """conv1d then the gated delta rule, as the layer calls them."""
    seq = (batch["state_indices"], batch["query_start_loc"], batch["has_initial_state"])
    x = module.causal_conv1d_varlen(batch["mixed"], batch["conv_weight"], None, batch["conv_states"], *seq)
    q, k, v = split_qkv(x, batch["shapes"])
    return module.gated_delta_rule_varlen(q, k, v, batch["g"], batch["beta"], batch["ssm_states"], *seq)


def fla_rule_call(fla_ops, batch, decode: bool):
    """fla's gated delta rule on the same inputs (conv from our kernel), state gathered and scattered."""
    x = batch["mixed"]  # fla's timing covers the rule only; the conv input stands in for the conv output
    q, k, v = split_qkv(x, batch["shapes"])
    idx = batch["state_indices"].long()
    group = v.shape[1] // q.shape[1]
    q, k, v = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1), v.contiguous()
    state = batch["ssm_states"][idx]
    fn = fla_ops.fused_recurrent_gated_delta_rule if decode else fla_ops.chunk_gated_delta_rule
    if decode:  # one token per sequence: fla's batch layout [B, 1, H, D]
        o, final = fn(q[:, None], k[:, None], v[:, None], batch["g"][:, None], batch["beta"][:, None],
                      initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    else:
        o, final = fn(q[None], k[None], v[None], batch["g"][None], batch["beta"][None], initial_state=state,
                      output_final_state=True, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=batch["query_start_loc"].long())
    batch["ssm_states"][idx] = final
    return o


def cases(device: str, tp: int) -> list[tuple[str, Shapes, list[int]]]:
    if device == "cpu":
        out = []
        for shapes in CPU_SHAPES:
            heads = f"{shapes.key_heads}/{shapes.value_heads}x{shapes.head_dim}"
            out += [(f"prefill 256 tok ({heads})", shapes, [256]), (f"prefill 1024 tok ({heads})", shapes, [1024]),
                    (f"decode b1 ({heads})", shapes, [1]), (f"decode b16 ({heads})", shapes, [1] * 16)]
        return out
    shapes = Shapes(QWEN36_27B.key_heads // tp, QWEN36_27B.value_heads // tp, QWEN36_27B.head_dim)
    return [("prefill 4096 tok", shapes, [4096]), ("prefill 4 x 1024 tok", shapes, [1024] * 4),
            ("decode b1", shapes, [1]), ("decode b16", shapes, [1] * 16), ("decode b64", shapes, [1] * 64)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench_gated_delta", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks the heads are split over")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:  # on a shared CPU one thread each is steadier than a thread pool that waits on its peers
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype if args.device == "cuda" else "float32")
    device = torch.device(args.device)
    impls = {"torch": gated_delta_torch}
    fla_ops = None
    if device.type == "cuda":
        from kernels import triton_causal_conv1d, triton_gated_delta

        class Ours:  # the two Triton modules behind the reference's two entry points
            causal_conv1d_varlen = staticmethod(triton_causal_conv1d.causal_conv1d_varlen)
            gated_delta_rule_varlen = staticmethod(triton_gated_delta.gated_delta_rule_varlen)
        impls["triton (ours)"] = Ours
        try:
            import fla.ops.gated_delta_rule as fla_ops
        except ImportError:
            print("fla not installed: its column is left out (pip install flash-linear-attention to add it)")
    header = ["case", *[f"{name} conv+rule ms" for name in impls]] + (["fla rule only ms"] if fla_ops else [])
    print(f"Gated DeltaNet layer kernels on {device} ({dtype}, state float32, tp={args.tp}); "
          f"median of {args.iters} calls")
    print(markdown_table(header, []), flush=True)
    for label, shapes, lengths in cases(device.type, args.tp):
        batch = make_batch(shapes, lengths, dtype, args.device, slots=max(64, len(lengths)))
        row = [label]
        for name, module in impls.items():
            iters = args.iters if name != "torch" or device.type == "cpu" else 3
            row.append(f"{median_ms(lambda _: layer_call(module, batch), 1, device, iters=iters):.3f}")
        if fla_ops:
            decode = max(lengths) == 1
            row.append(f"{median_ms(lambda _: fla_rule_call(fla_ops, batch, decode), 1, device, iters=args.iters):.3f}")
        print("| " + " | ".join(row) + " |", flush=True)  # row by row: a slow CPU case shows what it has


if __name__ == "__main__":
    main()
