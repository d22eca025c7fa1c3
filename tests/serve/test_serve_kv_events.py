"""`berth serve --kv-events-endpoint`: the engine's worker process publishes its prefix cache's
events; a subscriber of the real server sees the blocks a completion stored, under the engine
id it was given, and a sleep clears them."""

from __future__ import annotations

import hashlib
from array import array

from berth.engine.pyexecutor.kv_cache import _chain_root
from berth.engine.pyexecutor.kv_events import KVEventSubscriber
from tests.serve.server_process import ADMIN_TOKEN, ServerProcess


def test_a_served_engine_publishes_its_cache_events(tiny_model, tmp_path):
    events, snapshots = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-snapshots"
    server = ServerProcess(
        tiny_model,
        "--served-model-name", "tiny", "--kv-blocks", "64", "--kv-block-size", "8",
        "--kv-events-endpoint", events, "--kv-events-snapshot-endpoint", snapshots,
        "--kv-events-engine-id", "world-0",
        admin_token=ADMIN_TOKEN,
    )  # fmt: skip
    subscriber = None
    try:
        subscriber = KVEventSubscriber(events, snapshots)
        subscriber.sync()
        prompt = list(range(10, 30))  # 20 tokens: 2 full blocks of 8
        response = server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3})
        assert response.status_code == 200, response.text
        for _ in range(100):
            if len(subscriber.contents.blocks) >= 2:
                break
            subscriber.poll(0.1)
        assert subscriber.engine_id == "world-0"
        first = hashlib.sha256(_chain_root(None) + array("i", prompt[:8]).tobytes()).hexdigest()
        second = hashlib.sha256(bytes.fromhex(first) + array("i", prompt[8:16]).tobytes()).hexdigest()
        assert set(subscriber.contents.blocks) == {first, second}
        assert subscriber.contents.blocks[second]["parent"] == first
        headers = server.headers(ADMIN_TOKEN)
        assert server.post("/admin/sleep", {"level": 1}, headers=headers).status_code == 200
        for _ in range(100):
            if subscriber.contents.applied["AllBlocksCleared"]:
                break
            subscriber.poll(0.1)
        assert subscriber.contents.blocks == {}
    finally:
        if subscriber is not None:
            subscriber.close()
        server.stop()
