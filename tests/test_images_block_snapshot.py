"""Issue 35, Monitor: the block snapshot names the blocks holding image placeholder tokens (every KV cache group's,
window-freed ones left out), from the running requests' image spans, and the engine-state document carries them."""
from types import SimpleNamespace

from engine.core.block_snapshot import snapshot_blocks
from engine.kv.block_pool import NULL_BLOCK, BlockPool
from engine.multimodal.inputs import MultiModalInputs, MultiModalItem


def _seq(rid, tables, items):
    mm = MultiModalInputs(list(range(64)), items) if items else None
    return SimpleNamespace(request=SimpleNamespace(request_id=rid, mm=mm), block_tables=tables, state_slot=None,
                           num_prompt_tokens=64, num_computed_tokens=64, num_output_tokens=0)


def test_blocks_of_an_image_span_are_listed_in_every_group():
    pool = BlockPool(20)
    a = pool.get_new_blocks(4)  # full-attention group: tokens 0..63 at block size 16
    b = pool.get_new_blocks(4)  # a window group: its first block freed behind the window
    text = pool.get_new_blocks(2)
    image = MultiModalItem("h", offset=10, length=30, num_embeds=30)  # tokens 10..39: blocks 0, 1, 2
    seqs = [_seq("img", [a, [NULL_BLOCK] + b[1:]], [image]), _seq("txt", [text], [])]
    snap = snapshot_blocks(pool, seqs, [], ["full attention · 1 layer", "window 32 · 1 layer"], block_size=16)
    assert snap.image_blocks == sorted(x.block_id - 1 for x in a[:3] + b[1:3])  # picture entries: block id - 1
    assert snapshot_blocks(pool, seqs, []).image_blocks == []  # no block size: nothing marked


def test_the_engine_state_document_lists_image_blocks():
    from engine.core.outputs import BlockPoolSnapshot, EngineStats
    from engine.entrypoints.openai.engine_state import RawState, build_state
    import numpy as np
    snap = BlockPoolSnapshot(np.zeros(4, np.uint8), np.zeros(4, np.int32), np.full(4, -1, np.int32), [],
                             image_blocks=[2, 3])
    doc = build_state(RawState(snap, EngineStats(num_blocks=4, block_size=16), {}, "cpu"), "m", (0.0, 0.0))
    assert doc["image_blocks"] == [2, 3]
    snap.image_blocks = []
    assert "image_blocks" not in build_state(RawState(snap, EngineStats(num_blocks=4, block_size=16), {}, "cpu"),
                                             "m", (0.0, 0.0))


def test_a_real_vl_engine_marks_the_blocks_of_its_image():
    """A tiny Qwen3.5 VL engine after its first step: the blocks marked are those of the request's block table
    that its image's placeholder tokens fall in."""
    import tempfile

    import pytest
    pytest.importorskip("PIL")
    from engine import LLM, SamplingParams
    from tiny_vl_models import make_tiny_vl_model, random_image
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_tiny_vl_model(tmp, "qwen3_5-vl")), device="cpu", max_num_seqs=2, block_size=16)
        text = "<|im_start|>user\n" + "word " * 40 + "<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n"
        inputs = llm.engine.process_images(text, [random_image(56, 84, 0)])
        llm.engine.add_request("img", inputs.prompt_token_ids, SamplingParams(temperature=0, max_tokens=4), mm=inputs)
        llm.engine.step()
        (seq,) = llm.engine.scheduler.running
        item = inputs.items[0]
        table = seq.block_tables[0]
        expected = sorted({table[i].block_id - 1 for i in range(item.offset // 16, (item.end - 1) // 16 + 1)})
        assert item.offset >= 16 and llm.engine.block_pool_snapshot().image_blocks == expected
        assert table[0].block_id - 1 not in expected  # the text before the image is not marked
