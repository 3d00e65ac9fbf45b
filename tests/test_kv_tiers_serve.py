"""A real ``kvflow serve`` (tritonserver) restarted on the same ``--kv-disk-dir``: the second
server's first request finds its prefix in the disk tier the first server left."""

from __future__ import annotations

import pytest

from kvflow.client import stream_generate

pytestmark = pytest.mark.slow  # two tritonserver starts


def test_a_restarted_server_serves_a_returning_prefix_from_its_disk_tier(tiny_engines,
                                                                          tmp_path):
    from kvflow.triton_backend.launcher import ServerConfig, TritonServer

    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    args = {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_bytes": 1 << 24}
    prompt = "A shared system prompt that comes back after a restart. " * 2
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for _ in range(2):
        cfg = ServerConfig.on_free_ports(engine, args, ready_timeout_s=300)
        with TritonServer(cfg) as server:  # stopped by SIGTERM: the engine closes, persists
            outs.append(list(stream_generate(server.grpc_url, prompt, params,
                                             stream=False))[-1])
    first, second = outs
    assert first.cached_tokens == 0
    assert second.cached_tokens > 0 and second.cached_tokens % 4 == 0
    assert second.text == first.text and len(first.text) > 0
