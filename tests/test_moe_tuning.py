"""The fused-MoE tile table (kernels/moe_tuning.py): written and read back, the nearest tuned batch chosen, the
decode rule kept, other devices and shapes left alone, the default table when untuned, and a malformed file
named in the error. Pure Python: the kernel and the tuner's interpreter run are in tests/test_moe_triton.py."""
from __future__ import annotations

import json

import pytest

from kernels.moe_tuning import (ENV_PATH, MoETiles, default_moe_tiles, moe_tiles, read_table, shape_key,
                                table_path, tuned_tiles, write_entries)

CARD, KEY = "NVIDIA GeForce RTX 3090", shape_key("int4", 128, 2048, 768, 8)
DECODE, SMALL, LARGE = MoETiles(16, 32, 256, 1, 4, 5), MoETiles(32, 128, 64, 8, 4, 4), MoETiles(128, 128, 64, 16, 8, 3)


def test_table_round_trip_and_nearest_batch(tmp_path):
    path = tmp_path / "tiles.json"
    write_entries(path, CARD, KEY, {1: DECODE, 64: SMALL})
    write_entries(path, CARD, KEY, {2048: LARGE})  # merged into the same shape
    write_entries(path, "NVIDIA GeForce RTX 4090", KEY, {1: SMALL})  # another card
    data = json.loads(path.read_text())
    assert data["version"] == 1 and set(data["devices"]) == {CARD, "NVIDIA GeForce RTX 4090"}
    assert read_table(path)[CARD][KEY] == {"1": [16, 32, 256, 1, 4, 5], "64": [32, 128, 64, 8, 4, 4],
                                           "2048": [128, 128, 64, 16, 8, 3]}
    assert KEY == "int4 E128 H2048 I768 k8"
    assert tuned_tiles(CARD, KEY, 1, path) == DECODE
    assert tuned_tiles(CARD, KEY, 100, path) == SMALL  # nearest timed batch: 64
    assert tuned_tiles(CARD, KEY, 1500, path) == LARGE
    assert tuned_tiles("NVIDIA GeForce RTX 4090", KEY, 1, path) == SMALL
    assert tuned_tiles(CARD, shape_key("fp8", 128, 2048, 768, 8), 1, path) is None  # untuned shape
    assert tuned_tiles("NVIDIA A100", KEY, 1, path) is None  # untuned card
    assert tuned_tiles(CARD, KEY, 1, tmp_path / "missing.json") is None


def test_decode_steps_never_take_a_block_that_splits_an_expert(tmp_path):
    """Up to 16 tokens an expert may get 16 rows: a tuned BLOCK_M under the step's tokens would read its weights
    twice, so that entry is passed over (the next nearest, else the default)."""
    path = tmp_path / "tiles.json"
    write_entries(path, CARD, KEY, {1: DECODE, 16: MoETiles(8, 64, 64, 1, 4, 3), 64: SMALL})
    assert tuned_tiles(CARD, KEY, 12, path) == DECODE  # the nearer 16-token entry's BLOCK_M 8 < 12 tokens
    assert tuned_tiles(CARD, KEY, 8, path) == DECODE  # nearest is 1 anyway
    assert tuned_tiles(CARD, KEY, 20, path).block_m == 8  # past 16 tokens the rule is off: nearest, 16


def test_untuned_falls_back_to_the_default_table(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_PATH, str(tmp_path / "none.json"))
    assert table_path() == tmp_path / "none.json"
    for tokens in (1, 16, 17, 4096):
        assert moe_tiles(CARD, KEY, tokens, 8, 128) == default_moe_tiles(tokens, 8, 128)
    assert default_moe_tiles(1, 8, 128).block_m == 16 and default_moe_tiles(4096, 8, 128).block_m == 64


@pytest.mark.parametrize("text", ["{not json", json.dumps({"version": 0, "devices": {}}), "[]"])
def test_a_malformed_table_is_named(tmp_path, text):
    path = tmp_path / "tiles.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="MoE tile table .*tiles.json"):
        read_table(path)
