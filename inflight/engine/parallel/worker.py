"""Ranks 1..N-1 of a tensor-parallel engine: load this rank's shard, then replay rank 0's steps.

`python -m inflight.engine.parallel.worker FD`, started by group.py (the protocol and the failure rules
are described there), with FD its end of a pipe to rank 0. From rank 0: the `WorkerSpec`,
("allocate", num_blocks), then one pickled `StepInputs` per step and a pickled None to stop. To rank 0:
("started",), ("loaded", parameter bytes, KV blocks that fit here, bytes of one KV block here),
("ready",) or ("error", message).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

from inflight.engine.config import EngineConfig

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    init_method: str
    backend: str
    model_dir: str
    config: EngineConfig
    dtype: str
    device: str
    threads: int
    timeout_s: float
    parent_pid: int


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when rank 0 dies (Linux), and stay out of terminal signals:
    rank 0 alone decides when a worker stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # rank 0 died before the line above took effect
        os._exit(1)


def worker_main(pipe: Connection) -> None:
    try:
        spec: WorkerSpec = pipe.recv()
    except EOFError:
        os._exit(1)
    _die_with_parent(spec.parent_pid)
    try:
        _serve(spec, pipe)
    except EOFError:
        os._exit(0)  # rank 0 closed the pipe: it is gone or shutting down
    except BaseException as error:  # report anything to rank 0, then exit non-zero
        with contextlib.suppress(OSError):
            pipe.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"))
        os._exit(1)
    os._exit(0)


def _serve(spec: WorkerSpec, pipe: Connection) -> None:
    import torch
    import torch.distributed as dist

    from inflight.engine.cpu.allocator import retain_freed_memory
    from inflight.engine.cpu.linear import can_prepack, prepare_linears
    from inflight.engine.kv_budget import kv_block_bytes, kv_budget_bytes, kv_cache_dtype
    from inflight.engine.loader import load_model
    from inflight.engine.runner import allocate_kv_caches, run_model

    device = torch.device(spec.device)
    dtype = getattr(torch, spec.dtype)
    kv_dtype = kv_cache_dtype(spec.config, dtype)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(spec.threads)
        retain_freed_memory()
    pipe.send(("started",))
    dist.init_process_group(
        spec.backend,
        init_method=spec.init_method,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    config = spec.config
    model = load_model(
        spec.model_dir,
        dtype,
        device,
        rank=spec.rank,
        world_size=spec.world_size,
        quantization=config.quantization,
    )
    if can_prepack(device, dtype):
        prepare_linears(model, config.max_num_seqs)
    # Counted as rank 0 counts its own (quantized weights with their blocks and scales).
    parameter_bytes = sum(t.nbytes for t in model.weight_tensors().values())
    block_bytes = kv_block_bytes(model.config, model.layout.kv_heads, config.block_size, kv_dtype)
    pipe.send(("loaded", parameter_bytes, int(kv_budget_bytes(config, device) // block_bytes), block_bytes))
    message = pipe.recv()
    if message is None:  # rank 0 gave up during start-up
        return
    _, num_blocks = message
    kv_caches = allocate_kv_caches(
        model.config, num_blocks, config.block_size, kv_dtype, device, model.layout.kv_heads
    )
    pipe.send(("ready",))
    while True:
        inputs = pickle.loads(pipe.recv_bytes())
        if inputs is None:
            break
        run_model(model, kv_caches, inputs, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])))
