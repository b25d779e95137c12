"""Engine tests run torch single-threaded (support/torch_threads.py says why)."""

from support.torch_threads import one_torch_thread

__all__ = ["one_torch_thread"]
