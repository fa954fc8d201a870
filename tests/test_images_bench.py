"""`pagedesk-bench images` runs end to end on a random Qwen3.5-VL and prints its table (figures are taken on a
quiet machine, never asserted)."""
from __future__ import annotations

import pytest

pytest.importorskip("PIL")


def test_images_bench_prints_its_table(capsys):
    from engine.bench import main
    main(["images", "--image-size", "64", "--words", "4", "--repeats", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(lines) == 4 and "text alone" in lines[2] and "64x64 image" in lines[3]
    assert lines[3].split("|")[-2].strip() != "0"  # the same image again: tokens from the prefix cache
