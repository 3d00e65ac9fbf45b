"""kvflow: LLM serving with in-flight batching and a paged KV cache, in the open.

The public API mirrors vLLM's::

    from kvflow import LLM, SamplingParams
    llm = LLM("engines/smollm2-135m")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import kvflow.kv_manager` (the simulator, the Triton shim) stays light.
    if name == "LLM":
        from kvflow.orchestrator.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvflow.orchestrator.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
