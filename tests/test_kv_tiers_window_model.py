"""A windowed prefix restored from the disk tier on a real model: the tiny random-weight
Mistral (every layer windowed, 7 tokens, blocks of 4) restarted on the same ``kv_disk_dir``
restores only the blocks its next token's window reaches, and gives the greedy tokens of a
cold prefill, on the fp32 path."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvflow import SamplingParams  # noqa: E402
from kvflow.kv_manager.window import hit_run_blocks  # noqa: E402
from kvflow.orchestrator.llm import create_engine  # noqa: E402
from tests.test_kv_window_model import WINDOW, mistral  # noqa: E402,F401

pytestmark = pytest.mark.slow  # a model built and four engines opened, seconds
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def generate(engine_dir, runner, prompt, **options):  # type: ignore[no-untyped-def]
    """Greedy tokens, cached prompt tokens and the disk tier's hits (None without it)."""
    engine = create_engine(engine_dir, runner=runner, kv_cache_dtype="fp32", debug_checks=True,
                           **options)
    try:
        assert engine.kv.sliding_window == WINDOW
        engine.add_request(prompt, GREEDY, request_id="r")
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out = (list(o.outputs[0].token_ids), o.cached_tokens)
        engine.kv.check_integrity()
        tiers = engine.kv.tiers
        return (*out, tiers.counters["disk"].hits if tiers is not None else None)
    finally:
        engine.close()


@pytest.mark.parametrize("runner", ["torch", "onnxruntime"])
def test_a_windowed_prefix_restored_after_a_restart_gives_the_cold_tokens(mistral, runner,  # noqa: F811
                                                                         tmp_path):
    _, engines = mistral
    engine_dir = engines(runner)
    first = np.random.default_rng(3).integers(3, 320, 41).tolist()  # 10 full blocks
    returning = first[:40] + [11, 12, 13]
    disk = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=1 << 24)
    generate(engine_dir, runner, first, **disk)
    tokens, cached, hits = generate(engine_dir, runner, returning, **disk)
    cold, cold_cached, _ = generate(engine_dir, runner, returning, enable_prefix_caching=False)
    assert hits == hit_run_blocks(WINDOW, 4) == 2  # the blocks the window reaches, no more
    assert cached == 40 and cold_cached == 0
    assert tokens == cold
