"""The tensor-parallel step ring (engine/distributed/step_ring.py) and the worker loop on it (engine/tp_worker.serve): steps
are read in order with no answer, a command runs only after the steps published before it, a step too large
for a slot travels over the pipe in its place, and rank 0 waits for a slot (watching the workers) only while
a worker has not read the step it holds. In one process: the loop runs in a thread against a recording runner."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
from types import SimpleNamespace

import pytest
import torch

from engine.distributed.step_ring import StepRing
from engine.executor.tp_worker import serve

CTX = mp.get_context("spawn")


def test_steps_are_read_in_order_and_a_slot_is_reused_only_once_read():
    ring = StepRing(CTX, 2, num_slots=2, slot_bytes=64)
    a, b = ring.reader(0), ring.reader(1)
    assert ring.publish(b"one", lambda: None) == 1 and ring.publish(b"two", lambda: None) == 2
    assert a.take() == b.take() == b"one"
    a.done()
    assert a.take() == b"two" and b.take() == b"one"  # each worker has its own read mark
    assert ring.publish(b"x" * 65, lambda: None) is None and ring.seq == 3  # too large: counted, for the pipe
    checks = []

    def dead():  # reader b has not read step 1, whose slot step 4 needs: rank 0 waits, watching the workers
        checks.append(1)
        raise RuntimeError("worker rank 2 died")

    with pytest.raises(RuntimeError, match="died"):
        ring.publish(b"four", dead)
    assert checks == [1]


class RecordingRunner:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls = []

    def run(self, inputs, sampling=None):
        self.calls.append(("run", inputs))

    def kv_cache_bytes(self):
        self.calls.append(("kv_cache_bytes",))
        return 7


def test_the_worker_runs_ring_steps_unanswered_and_commands_after_their_steps():
    ring = StepRing(CTX, 1, num_slots=4, slot_bytes=256)
    commands_in, commands_out = CTX.Pipe(duplex=False)
    results_in, results_out = CTX.Pipe(duplex=False)
    runner = RecordingRunner()
    worker = threading.Thread(target=lambda: setattr(worker, "code", serve(runner, commands_in, results_out, None,
                                                                           ring.reader(0))))
    worker.start()
    try:
        for step in range(3):
            ring.publish(pickle.dumps(SimpleNamespace(step=step)), lambda: None)
        big = SimpleNamespace(step=3, pad="x" * 300)
        assert ring.publish(pickle.dumps(big), lambda: None) is None
        commands_out.send(("run_step", (big,), ring.seq - 1))  # what the executor sends in the ring's place
        ring.publish(pickle.dumps(SimpleNamespace(step=4)), lambda: None)
        commands_out.send(("kv_cache_bytes", (), ring.seq))
        ring.wake()
        assert results_in.poll(60) and results_in.recv() == ("ok", 7)  # the only answer: the command's
        assert [c[1].step if c[0] == "run" else c[0] for c in runner.calls] == [0, 1, 2, 3, 4, "kv_cache_bytes"]
        commands_out.send(("shutdown", (), ring.seq))
        ring.wake()
        worker.join(60)
        assert not worker.is_alive() and worker.code == 0 and not results_in.poll()
    finally:
        commands_out.close()
        worker.join(60)


def test_a_step_seen_before_its_payload_is_not_taken():
    """Issue 32: on a weakly ordered CPU (aarch64) a worker may see the step number before the payload written
    ahead of it. The reader checks the copied payload against the CRC-32 in the header: a slot whose bytes are
    not all there yet reads as not published, and the next poll takes it."""
    import struct
    import zlib

    ring = StepRing(CTX, 1, num_slots=2, slot_bytes=64)
    reader = ring.reader(0)
    view = memoryview(ring.buffer).cast("B")
    at = ring._slot(1)
    payload = b"step one, all of it"
    struct.pack_into("<QQQ", view, at, 1, len(payload), zlib.crc32(payload))  # the header is visible first
    view[at + 24:at + 24 + 9] = payload[:9]  # and only part of the payload
    assert reader.take() is None
    view[at + 24:at + 24 + len(payload)] = payload
    assert reader.take() == payload
