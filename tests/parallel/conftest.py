"""Tensor-parallel tests run real worker processes over gloo; every process uses one torch thread."""

from support.torch_threads import one_torch_thread

__all__ = ["one_torch_thread"]
