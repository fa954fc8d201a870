"""`pagedesk-bench forward-ops`: the torch ops one decode forward of the model dispatches, by op name, on the CPU.

A clock-free measure of the eager forward's overhead (each dispatched op costs microseconds on a CPU whatever its
size, so a small model's decode forward is paid per op): B requests decode greedily and `runner.model`'s forward of
one step runs under a `TorchDispatchMode` that counts every op it sees (the logits and sampling are left out; a
numba kernel dispatches nothing inside, but each tensor it is handed as a numpy array counts four ops: detach, to,
resolve_conj, resolve_neg, well under a microsecond together). Prints a table of ops per forward and the total.
"""
from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path


def count_forward_ops(engine, num_steps: int = 1) -> Counter:
    """Torch ops by name over `num_steps` forwards of the engine's model (the running requests' decode steps),
    divided by the step count."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: Counter = Counter()

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    model = engine.runner.model
    forward = model.forward

    def counted(*args, **kwargs):
        with CountOps():
            return forward(*args, **kwargs)

    model.forward = counted
    try:
        for _ in range(num_steps):
            engine.step()
    finally:
        del model.forward  # the instance attribute goes; the class's method is back
    return Counter({name: n / num_steps for name, n in ops.items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench forward-ops", description=__doc__)
    parser.add_argument("--model", type=Path, help="model folder (default: the peer bench's 2-layer random Llama)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args(argv)
    from engine import LLM
    from engine.sample.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from engine.bench.random_model import PEER_LLAMA, make_random_llama
        path = args.model or make_random_llama(Path(tmp) / "peer-llama", **PEER_LLAMA)
        llm = LLM(str(path), device="cpu", max_model_len=args.prompt_len + 4 * args.steps + 64,
                  max_num_seqs=args.batch)
        engine = llm.engine
        vocab = engine.model_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=4 * args.steps + 8, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request(f"ops-{i}", [4 + (i * 131 + j * 17) % (vocab - 4) for j in range(args.prompt_len)],
                               params)
        for _ in range(3):  # the prompts, then decodes only
            engine.step()
        ops = count_forward_ops(engine, args.steps)
    print(f"\n{path.name}: torch ops per decode forward, batch {args.batch} ({args.steps} steps)\n")
    print("| op | per forward |\n|---|---:|")
    for name, n in ops.most_common():
        print(f"| {name} | {n:g} |")
    print(f"| total | {sum(ops.values()):g} |")


if __name__ == "__main__":
    main()
