"""Engine-state decoding (docs/engine-state.md) and the SSE stats client: off-thread, authenticated,
and reconnecting by itself when the engine goes away and comes back."""
import qt_helpers as helpers

import numpy as np

from app.engine_state import decode_blocks, encode_blocks, parse_state
from app.stats_client import StatsClient
from app.supervisor import EngineSupervisor


def test_blocks_round_trip_and_parse():
    state = np.array([0, 1, 1, 2], np.uint8)
    ref = np.array([0, 1, 2, 0], np.uint8)
    owner = np.array([0, 1, 300, 0], np.uint16)
    s, r, o = decode_blocks(encode_blocks(state, ref, owner), 4)
    assert (s == state).all() and (r == ref).all() and (o == owner).all() and o.dtype == np.uint16
    parsed = parse_state({"num_blocks": 4, "blocks": encode_blocks(state, ref, owner), "model": "m",
                          "requests": [{"id": "cmpl-9"}], "kv_cache_usage": 0.5, "memory": {"weights_bytes": 7}})
    assert parsed.blocks.owners == ["cmpl-9"] and parsed.kv_cache_usage == 0.5 and parsed.weights_bytes == 7


def test_stream_with_api_key_and_reconnect(qtbot):
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    port = helpers.free_port()
    values = {"host": "127.0.0.1", "port": port, "api_key": "sk-test"}
    client = StatsClient()
    try:
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            sup.start("/m", values)
        with qtbot.waitSignal(client.state, timeout=5000) as got:
            client.start(sup.base_url, "sk-test", hz=20)
        state = got.args[0]
        assert state.model == "fake-model" and state.num_blocks == 256 and state.blocks.num_blocks == 256
        with qtbot.waitSignals([client.connected, sup.state_changed], timeout=5000,
                               check_params_cbs=[lambda ok: not ok, lambda s: s == "STOPPED"]):
            sup.stop()
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            sup.restart()
        with qtbot.waitSignal(client.state, timeout=5000):
            pass  # the same client picked the restarted engine up
    finally:
        client.wait_stopped()
        sup.shutdown()


def test_wrong_key_reports_not_connected(qtbot):
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    client = StatsClient()
    try:
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            sup.start("/m", {"host": "127.0.0.1", "port": helpers.free_port(), "api_key": "right"})
        received = []
        client.state.connect(received.append)
        with qtbot.waitSignal(client.connected, timeout=5000, check_params_cb=lambda ok: not ok):
            client.start(sup.base_url, "wrong")
        assert received == []
    finally:
        client.wait_stopped()
        sup.shutdown()
