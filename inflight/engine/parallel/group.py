"""Rank 0's side of tensor parallelism: spawn the other ranks, set up the process group, send each step.

The engine process is rank 0: it owns the scheduler, samples, and talks to ranks 1..N-1 (spawned worker
processes, see worker.py) over one pipe each. A pipe carries the control messages of start-up (loaded,
KV pool size, ready) and then, once per step, the step's inputs (`StepInputs`, pickled once and written
to every pipe). Inside the model's forward pass the ranks meet in torch.distributed collectives (gloo on
CPU, NCCL on CUDA) whose timeout bounds how long a hung rank can stall a step.

Failure handling: a rank that exits (crash, SIGKILL, out of memory) is noticed by a watcher thread at
once, and by the next collective or pipe write; either way the group is dead, the other workers are
stopped, and the engine raises `EngineDeadError`. Workers ignore SIGINT/SIGTERM (rank 0 decides when they
stop), exit when their pipe closes, and on Linux are killed by the kernel if rank 0 dies (PDEATHSIG),
so no path leaves a worker behind.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import Pipe, connection
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from inflight.engine.config import EngineConfig
from inflight.engine.errors import EngineDeadError
from inflight.engine.loader import read_config
from inflight.engine.model.errors import ModelLoadError
from inflight.engine.model.llama import shard_layout
from inflight.engine.parallel.worker import WorkerSpec
from inflight.engine.runner import StepInputs

logger = logging.getLogger("inflight.engine")

# How long a collective (and each start-up phase) may wait for the other ranks before the engine is
# declared dead. Generous: the first steps of a large model on a slow machine are slow on every rank.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("INFLIGHT_TP_TIMEOUT_S", "300"))
# How long a worker may take to exit after the stop message before it is killed.
STOP_GRACE_S = 10.0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r on CUDA (one GPU per rank), the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def check_degree(model_dir: Path, size: int, device: torch.device) -> None:
    """Fail before spawning anything when `size` ranks cannot split the model or there are too few GPUs."""
    config = read_config(model_dir)
    try:
        shard_layout(config, 0, size)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from e
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"tensor-parallel size {size} needs {size} GPUs, but {torch.cuda.device_count()} are visible"
        )


class TensorParallelGroup:
    """Ranks 1..N-1 of one engine, seen from rank 0. `start` returns once they joined the process group."""

    def __init__(
        self, size: int, processes: list[subprocess.Popen[bytes]], pipes: list[Connection], rendezvous: Path
    ) -> None:
        self.size = size
        self._processes = processes
        self._pipes = pipes
        self._rendezvous = rendezvous
        self._lock = threading.Lock()
        self._stopped = False
        self._closed = False
        self.error: EngineDeadError | None = None
        # Called from the watcher thread when a rank dies while the engine is idle.
        self.on_failure: Callable[[EngineDeadError], None] | None = None
        self.parameter_bytes: list[int] = []
        # Bytes of one KV block on each worker (its KV heads' share), as reported with its fit.
        self.block_bytes: list[int] = []
        atexit.register(self.close)

    @classmethod
    def start(
        cls, model_dir: Path, config: EngineConfig, dtype: torch.dtype, device: torch.device
    ) -> TensorParallelGroup:
        size = config.tensor_parallel_size
        check_degree(model_dir, size, device)
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group already exists in this process: run one "
                "tensor-parallel engine per process (close the other engine first)"
            )
        rendezvous = Path(tempfile.mkdtemp(prefix="inflight-tp-"))
        init_method = f"file://{rendezvous / 'store'}"
        threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else 1
        if device.type == "cpu":
            # The engine process's CPU threads are shared among the ranks.
            torch.set_num_threads(threads)
        # A plain interpreter per rank (not multiprocessing's spawn, which re-imports the caller's
        # __main__): the pipe's other end is handed over as an inherited file descriptor.
        package_root = str(Path(__file__).resolve().parents[3])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        }
        group = cls(size, [], [], rendezvous)
        try:
            for rank in range(1, size):
                spec = WorkerSpec(
                    rank=rank,
                    world_size=size,
                    init_method=init_method,
                    backend=backend_for(device),
                    model_dir=str(model_dir),
                    config=config,
                    dtype=str(dtype).removeprefix("torch."),
                    device=str(rank_device(device, rank)),
                    threads=threads,
                    timeout_s=COLLECTIVE_TIMEOUT_S,
                    parent_pid=os.getpid(),
                )
                group._spawn(spec, env)
            group._expect("started")
            if device.type == "cuda":
                torch.cuda.set_device(rank_device(device, 0))
            dist.init_process_group(
                backend_for(device),
                init_method=init_method,
                rank=0,
                world_size=size,
                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            )
        except BaseException:
            group.close()
            raise
        pids = ", ".join(str(p.pid) for p in group._processes)
        logger.info("tensor parallel: %d ranks (%s); worker pids %s", size, backend_for(device), pids)
        return group

    # ---- start-up handshake

    def _spawn(self, spec: WorkerSpec, env: dict[str, str]) -> None:
        ours, theirs = Pipe(duplex=True)
        command = [sys.executable, "-m", "inflight.engine.parallel.worker", str(theirs.fileno())]
        self._processes.append(subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env))
        self._pipes.append(ours)
        theirs.close()
        ours.send(spec)

    def _expect(self, kind: str) -> list[tuple[Any, ...]]:
        """Each worker's next message, which must be `kind`; a worker's error or death raises."""
        replies = []
        for rank, (process, pipe) in enumerate(zip(self._processes, self._pipes, strict=True), start=1):
            if not pipe.poll(COLLECTIVE_TIMEOUT_S):
                raise self._dead(f"rank {rank} {self._exit_status(process)} while starting")
            try:
                message = pipe.recv()
            except EOFError:
                raise self._dead(f"rank {rank} {self._exit_status(process)} while starting") from None
            if message[0] == "error":
                raise ModelLoadError(f"tensor-parallel rank {rank} failed to start: {message[1]}")
            if message[0] != kind:
                raise RuntimeError(f"rank {rank} sent {message[0]!r} while {kind!r} was expected")
            replies.append(message)
        return replies

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (ranks 1..N-1)."""
        return [process.pid for process in self._processes]

    def smallest_fit(self, own_fit: int) -> int:
        """The KV blocks that fit on every rank: the smallest of rank 0's `own_fit` and the workers'."""
        replies = self._expect("loaded")
        self.parameter_bytes = [reply[1] for reply in replies]
        self.block_bytes = [reply[3] for reply in replies]
        return min([own_fit, *(reply[2] for reply in replies)])

    def allocate(self, num_blocks: int) -> None:
        """Have every worker allocate its KV pool of `num_blocks` blocks, wait until they did, then start
        watching them (the last start-up step)."""
        for pipe in self._pipes:
            pipe.send(("allocate", num_blocks))
        self._expect("ready")
        threading.Thread(target=self._watch, name="inflight-tp-watch", daemon=True).start()

    # ---- steps

    def send_step(self, inputs: StepInputs) -> None:
        if self.error is not None:
            raise self.error
        data = pickle.dumps(inputs, protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in self._pipes:
            pipe.send_bytes(data)

    def failure(self, error: BaseException) -> EngineDeadError:
        """The error to raise after a step failed on rank 0 (a collective or a pipe): the group is dead."""
        if self.error is not None:
            return self.error
        dead = [
            f"rank {rank} {self._exit_status(p)}"
            for rank, p in enumerate(self._processes, start=1)
            if _wait_exit(p, 1.0) is not None
        ]
        cause = "; ".join(dead) if dead else f"a collective failed ({error})"
        return self._dead(cause)

    # ---- failures and shutdown

    def _dead(self, cause: str) -> EngineDeadError:
        with self._lock:
            if self.error is None:
                self.error = EngineDeadError(
                    f"tensor parallelism stopped: {cause}; the engine cannot continue and must be restarted"
                )
            error = self.error
        self._stop_workers()
        return error

    @staticmethod
    def _exit_status(process: subprocess.Popen[bytes]) -> str:
        code = _wait_exit(process, 1.0)
        if code is None:
            return f"(pid {process.pid}) did not answer"
        if code < 0:
            import signal

            return f"(pid {process.pid}) was killed by {signal.Signals(-code).name}"
        return f"(pid {process.pid}) exited with status {code}"

    def _watch(self) -> None:
        """Notice a worker that exits on its own (the engine may be idle, waiting for requests): its pipe,
        which it never writes to during steps, turns readable (an error report, or end of file)."""
        readable = connection.wait(self._pipes)
        if self._stopped:
            return
        ranks = [r for r, pipe in enumerate(self._pipes, start=1) if pipe in readable]
        error = self._dead("; ".join(f"rank {r} {self._exit_status(self._processes[r - 1])}" for r in ranks))
        logger.error("%s", error)
        if self.on_failure is not None:
            self.on_failure(error)

    def _stop_workers(self) -> None:
        """Ask every worker to stop, kill those that do not within the grace period; idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        for pipe in self._pipes:
            with contextlib.suppress(OSError):  # that worker is gone already
                pipe.send_bytes(pickle.dumps(None))
        for process in self._processes:
            if _wait_exit(process, STOP_GRACE_S) is None:
                process.kill()
                process.wait()
        for pipe in self._pipes:
            pipe.close()

    def close(self) -> None:
        """Stop every worker and leave the process group (from the engine's thread); idempotent."""
        self._stop_workers()
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._rendezvous, ignore_errors=True)
        atexit.unregister(self.close)


def _wait_exit(process: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The process's exit status once it exited within `timeout` seconds, else None."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
