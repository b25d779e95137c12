"""inflight: continuous batching over a paged KV cache, an OpenAI-compatible server, a Kubernetes operator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from inflight.engine.llm import LLM
    from inflight.engine.sequence import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import inflight` must not import torch (the operator image has none).
    if name == "LLM":
        from inflight.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from inflight.engine.sequence import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'inflight' has no attribute {name!r}")
