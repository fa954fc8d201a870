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


def test_images_plan_prints_text_and_image_rows(capsys):
    """`pagedesk-bench images-plan` (torch-free): a row per checkpoint and card count; with images never more
    context than as text, and the 2-card Qwen3.6-27B row pays for tower and encoder cache."""
    from engine.bench import main
    main(["images-plan"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 10 and rows[1][0].strip() == "Qwen3.6-27B AWQ" and rows[1][1].strip() == "2 × 24 GiB"
    assert all(int(row[-1].strip().replace(",", "")) <= 0 for row in rows)
    assert int(rows[1][-1].strip().replace(",", "")) < 0 and rows[1][5].strip() == "320 MiB"
