"""The README's offline example (the seed article's script with only the import and model changed) runs."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_offline_example_runs(llama_dir, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    script = next(b for b in blocks if "from engine import LLM, SamplingParams" in b)
    assert 'model="Qwen/Qwen2.5-7B-Instruct"' in script
    script = script.replace('"Qwen/Qwen2.5-7B-Instruct"', repr(str(llama_dir)))
    script = script.replace("SamplingParams(temperature=0.7, max_tokens=128)",
                            "SamplingParams(temperature=0.7, max_tokens=12)")  # same script, shorter run
    exec(compile(script, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.count("Prompt: ") == 2 and printed.count("Generated: ") == 2
    assert "lock-free ring buffer" in printed
