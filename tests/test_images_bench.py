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
    context than as text, the 2-card Qwen3.6-27B row pays for tower and encoder cache, and the rows resized by
    --mm-processor-kwargs (which they name) keep more context than the processor's largest image."""
    from engine.bench import main
    main(["images-plan"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    number = lambda cell: int(cell.strip().split(" ")[0].replace(",", ""))  # noqa: E731
    assert len(rows) == 16 and rows[1][0].strip() == "Qwen3.6-27B AWQ" and rows[1][1].strip() == "2 × 24 GiB"
    assert all(number(row[-1]) <= 0 for row in rows)
    assert number(rows[1][-1]) < 0 and rows[1][7].strip() == "320 MiB"
    processor, capped = rows[4:6], rows[6:8]  # 2,048-token steps: the processor's 16.7 MP, then resized to 12.2 MP
    assert all(number(c[4]) < number(p[4]) and number(c[-2]) > number(p[-2]) for p, c in zip(processor, capped))
    assert all("processor's own" in p[4] and "--mm-processor-kwargs max_pixels" in c[4]
               for p, c in zip(processor, capped))
