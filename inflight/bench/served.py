"""`inflight bench serve`: the offline benchmark's workload as streaming HTTP requests at a fixed rate.

Each request is a streaming /v1/completions call with the workload's prompt token ids, greedy,
ignore_eos and max_tokens = the request's output length, so the server generates exactly the tokens the
offline engine does. Measured per request: time to first token (TTFT), the gaps between streamed chunks
(inter-token latency, ITL: one chunk per engine step, several steps merged when the server lags),
end-to-end latency, time per output token after the first (TPOT, which unlike ITL does not depend on
how tokens are packed into chunks), and output tokens (from the stream's usage); per server and round,
the CPU its processes and the client used per output token. Then the same workload
runs through the offline engine in this process with the same engine settings, and the report gives
served output tokens/s divided by offline tokens/s.

The servers the benchmark starts (inflight, and vLLM-CPU or llama-server with --compare) either run
`together`, all started once and the idle ones paused, or `one-at-a-time`, each started for its turn and
stopped after it, so that only one holds memory (`--servers`; `auto` picks `together` when their memory
estimates, and the offline engine's, fit in the memory available). Either way the systems alternate
round by round, and neither the time to start a server nor its warm-up requests is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import httpx

from inflight.bench import vllm_cpu
from inflight.bench.servers_mode import MEMORY_MARGIN, ONE_AT_A_TIME, TOGETHER
from inflight.bench.workload import (
    BLOCK_SIZE,
    BenchRequest,
    kv_blocks_for,
    load_workload,
    longest_request,
    sampling_name,
    warmup_prompt,
    with_sampling,
)
from inflight.engine.cpu import openmp
from inflight.engine.cpu.isa import cpu_isa
from inflight.engine.cpu.memory_limit import available_memory_bytes
from inflight.engine.dtypes import resolve_dtype_name
from inflight.engine.model.config import ModelConfig
from inflight.engine.model.errors import ModelLoadError
from inflight.sizing import (
    GIB,
    EngineLimits,
    Formats,
    ModelShape,
    engine_bytes,
    kv_bytes_per_token,
    shape_of_config,
)

READY_TIMEOUT_S = 600.0
# A server that has not ended this long after SIGTERM is killed.
STOP_TIMEOUT_S = 60.0
WARMUP_TOKENS = 4
# llama-server's KV cache element type (its default --cache-type-k and --cache-type-v, f16).
LLAMA_CPP_KV_DTYPE = "float16"


def _say(message: str) -> None:
    print(f"bench serve: {message}", file=sys.stderr, flush=True)


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int
    expected_output_tokens: int
    start: float
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class HTTPStatusError(Exception):
    pass


async def _sse_payloads(host: str, port: int, path: str, body: bytes) -> AsyncIterator[bytes]:
    """POST `body` and yield each SSE event's data. A bare asyncio HTTP/1.1 client: the benchmark's
    client shares the machine with the server, so it spends as little CPU as it can (no JSON parsing
    per token, no HTTP library layers)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            raise HTTPStatusError(f"HTTP {status}: {(await reader.read(300)).decode(errors='replace')}")
        if headers.get("transfer-encoding") != "chunked":
            raise HTTPStatusError("expected a chunked event stream")
        pending = b""
        while size := int((await reader.readline()).split(b";")[0], 16):
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:]
    finally:
        writer.close()


async def _one_request(
    host: str, port: int, model: str, request: BenchRequest, delay: float, t0: float
) -> RequestResult:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    start = time.perf_counter()
    result = RequestResult(len(request.prompt_token_ids), 0, request.output_len, start - t0)
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.temperature > 0:
        # Every server samples from the same distribution: the temperature and top_p alone. llama-server's
        # own defaults would also cut it to the 40 most likely tokens and drop those under 5 % of the
        # likeliest's probability (top_k 40, min_p 0.05); vLLM's and inflight's are off.
        body |= {"top_k": 0, "min_p": 0.0}
    if request.schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": request.schema, "strict": True},
        }
    last = start
    try:
        async for payload in _sse_payloads(host, port, "/v1/completions", json.dumps(body).encode()):
            if payload.startswith(b'{"error"'):
                result.error = json.loads(payload)["error"]["message"]
                return result
            if b'"usage":{' in payload:  # the usage chunk: its own (OpenAI, vLLM) or the last (llama-server)
                chunk = json.loads(payload)
                result.output_tokens = chunk["usage"]["completion_tokens"]
                if not any(choice.get("text") for choice in chunk["choices"]):
                    continue
            if payload == b"[DONE]":
                continue
            now = time.perf_counter()
            if result.ttft is None:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, HTTPStatusError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e = time.perf_counter() - start
    if result.output_tokens != request.output_len:
        result.error = f"got {result.output_tokens} output tokens, wanted {request.output_len}"
    return result


def arrival_offsets(count: int, request_rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of `count` requests is sent: Poisson arrivals at
    `request_rate`/s from the first at 0 (inf = all at 0), the same for the same seed."""
    rng = random.Random(seed)
    offsets, at = [], 0.0
    for _ in range(count):
        offsets.append(at)
        if math.isfinite(request_rate):
            at += rng.expovariate(request_rate)
    return offsets


@dataclass(frozen=True)
class Load:
    """How the requests arrive: Poisson at `rate` per second (inf = all at once), or, with `concurrency`,
    from that many clients in a closed loop (each sends its next request when its last one has ended)."""

    rate: float = math.inf
    concurrency: int | None = None

    @property
    def name(self) -> str:
        if self.concurrency is not None:
            return f"concurrency-{self.concurrency}"
        return "all-at-once" if math.isinf(self.rate) else f"poisson-{self.rate:g}"

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"{self.concurrency} at a time (closed loop)"
        return "all at once" if math.isinf(self.rate) else f"Poisson {self.rate:g} req/s"


async def run_clients(
    url: str,
    model: str,
    requests: list[BenchRequest],
    request_rate: float,
    seed: int,
    concurrency: int | None = None,
) -> tuple[list[RequestResult], float]:
    """Send `requests` with Poisson arrivals at `request_rate`/s (inf = all at once), or, with
    `concurrency`, at most that many at a time, the next as soon as one ends; wall time too."""
    parsed = urlsplit(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise SystemExit(f"--url {url}: the benchmark client speaks plain http://HOST:PORT only")
    host, port = parsed.hostname, parsed.port or 80
    delays = arrival_offsets(len(requests), request_rate, seed)
    t0 = time.perf_counter()
    if concurrency is not None:
        slots = asyncio.Semaphore(concurrency)

        async def closed_loop(request: BenchRequest) -> RequestResult:
            async with slots:
                return await _one_request(host, port, model, request, time.perf_counter() - t0, t0)

        results = await asyncio.gather(*(closed_loop(r) for r in requests))
        return list(results), time.perf_counter() - t0
    results = await asyncio.gather(
        *(_one_request(host, port, model, r, d, t0) for r, d in zip(requests, delays, strict=True))
    )
    return list(results), time.perf_counter() - t0


def time_per_output_token(result: RequestResult) -> float:
    """Seconds per output token after the first: (end-to-end - TTFT) / (output tokens - 1). Unlike the
    chunk gaps (ITL) it does not depend on how the server packs tokens into chunks: a server that merges
    a lagging client's tokens into one chunk and one that sends a burst of one-token chunks back to back
    deliver the same tokens at the same times, and get the same TPOT, but very different ITLs."""
    assert result.e2e is not None and result.ttft is not None and result.output_tokens > 1
    return (result.e2e - result.ttft) / (result.output_tokens - 1)


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itls]
    tpots = [time_per_output_token(r) for r in ok if r.output_tokens > 1]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    output_tokens = sum(r.output_tokens for r in ok)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 2)

    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(duration, 3),
        "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "request_throughput_per_s": len(ok) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "ttft_ms": {"p50": ms(percentile(ttfts, 50)), "p99": ms(percentile(ttfts, 99))},
        "itl_ms": {"p50": ms(percentile(itls, 50)), "p99": ms(percentile(itls, 99))},
        "tpot_ms": {"p50": ms(percentile(tpots, 50)), "p99": ms(percentile(tpots, 99))},
        "e2e_ms": {"p50": ms(percentile(e2es, 50)), "p99": ms(percentile(e2es, 99))},
    }


def _process_group_stats(pgid: int) -> list[list[str]] | None:
    """The /proc/PID/stat fields after "pid (comm) " (state, ppid, pgrp, ...) of every process of process
    group `pgid` (a server and the processes it started: vLLM's engine core and worker); None without
    Linux's /proc."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            found.append(fields)
    return found


def process_group_cpu_seconds(pgid: int) -> float | None:
    """User + system CPU seconds used so far by the processes of process group `pgid`; None without /proc."""
    stats = _process_group_stats(pgid)
    if stats is None:
        return None
    # utime and stime are the 12th and 13th fields after "pid (comm) ".
    return sum(int(fields[11]) + int(fields[12]) for fields in stats) / os.sysconf("SC_CLK_TCK")


def process_group_resident_mib(pgid: int) -> float | None:
    """Resident memory of the processes of process group `pgid` summed, in MiB (pages they share count once
    per process); None without /proc."""
    stats = _process_group_stats(pgid)
    if stats is None:
        return None
    # rss (pages) is the 22nd field after "pid (comm) ".
    return round(sum(int(fields[21]) for fields in stats) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def process_group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still alive (a zombie holds no memory: it does not count)."""
    return any(fields[0] != "Z" for fields in _process_group_stats(pgid) or [])


def cpu_per_output_token(cpu_seconds: float | None, output_tokens: int) -> float | None:
    """Microseconds of CPU per output token, rounded; None when unmeasured or nothing was generated."""
    if cpu_seconds is None or output_tokens == 0:
        return None
    return round(cpu_seconds / output_tokens * 1e6, 1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ServedSystem:
    """A server the benchmark streams the workload to: inflight (always), vLLM (--compare vllm) or
    llama-server (--compare llama-cpp)."""

    name: str
    url: str
    model: str
    ready_path: str
    # The server's command line for a port; None: a server the benchmark does not start (--url).
    command: Callable[[int], list[str]] | None = None
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        """Whether the benchmark started this server and it has not ended."""
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start the server on a free port, in its own process group so that pause() and stop() reach the
        processes it starts (vLLM's engine core and worker)."""
        assert self.command is not None
        port = free_port()
        command = self.command(port)
        _say(f"starting {self.name}: {' '.join(command[1:])}")
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(command, env=self.env, start_new_session=True)

    def cpu_seconds(self) -> float | None:
        """CPU used so far by this server's processes; None for a server the benchmark did not start."""
        if self.process is None:
            return None
        return process_group_cpu_seconds(self.process.pid)

    def pause(self) -> None:
        """Stop every process of this server (SIGSTOP to its process group) while another system is
        measured: an idle vLLM-CPU worker busy-polls and would take CPU from it."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM the server (SIGKILL after STOP_TIMEOUT_S), then SIGKILL what is left of its process group:
        when this returns, none of its processes holds memory."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.resume()
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        pgid = self.process.pid
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while process_group_alive(pgid) and time.monotonic() < deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.05)


def _inflight_command(args: argparse.Namespace, model_dir: Path, port: int, num_kv_blocks: int) -> list[str]:
    command = [
        sys.executable, "-m", "inflight.cli", "serve", "--model", str(model_dir), "--port", str(port),
        "--served-model-name", "bench", "--dtype", args.dtype, "--max-slots", str(args.max_slots),
        "--num-kv-blocks", str(num_kv_blocks), "--block-size", str(BLOCK_SIZE),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--scheduler", args.scheduler,
        "--max-merged-prefill-tokens", str(args.max_merged_prefill_tokens),
        "--max-queue", str(args.num_requests), "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--quantization", args.quantization, "--log-level", "warning",
    ]  # fmt: skip
    command += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.max_prefill_tokens_while_decoding is not None:
        command += ["--max-prefill-tokens-while-decoding", str(args.max_prefill_tokens_while_decoding)]
    if not args.enable_prefix_caching:
        command.append("--no-enable-prefix-caching")
    if args.speculative is not None:
        command += [
            "--speculative", args.speculative,
            "--num-speculative-tokens", str(args.num_speculative_tokens),
            "--ngram-min", str(args.ngram_min), "--ngram-max", str(args.ngram_max),
            "--speculative-max-running", str(args.speculative_max_running),
        ]  # fmt: skip
        if args.draft_model is not None:
            command += ["--draft-model", args.draft_model]
    return command


def _vllm_command(args: argparse.Namespace, model_dir: Path, port: int, longest: int) -> list[str]:
    # `vllm serve` fails on vllm-cpu's package metadata; the module entry point works.
    return [
        str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir.resolve()), "--port", str(port), "--served-model-name", "bench",
        "--dtype", args.dtype, "--max-num-seqs", str(args.max_slots),
        "--max-num-batched-tokens", str(max(args.max_num_batched_tokens, longest)),
        "--max-model-len", str(longest), "--seed", "0", "--disable-log-stats",
        "--uvicorn-log-level", "warning",
        "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
        "--kv-cache-dtype", args.kv_cache_dtype,
    ]  # fmt: skip


def _llama_context(args: argparse.Namespace, longest: int) -> int:
    """llama-server's -c, the context of all its slots together (split over -np): one slot per request in
    flight, each with the workload's longest sequence."""
    return args.max_slots * longest


def _llama_server_command(args: argparse.Namespace, gguf_file: Path, port: int, longest: int) -> list[str]:
    """llama-server's command line. Without --enable-prefix-caching its prompt caches are off, as the other
    servers' are: by default it reuses a slot's last prompt and keeps past prompts' K/V in memory
    (--cache-ram, 8 GiB), so each round after the first found the workload's prompts cached (SmolLM2,
    concurrency 1: TTFT p50 14-19 ms in those rounds, 122 ms in the first)."""
    caches = [] if args.enable_prefix_caching else ["--cache-ram", "0", "--no-cache-prompt"]
    return [
        str(args.llama_server), "-m", str(gguf_file), "--host", "127.0.0.1", "--port", str(port),
        "-a", "bench", "-np", str(args.max_slots), "-c", str(_llama_context(args, longest)),
        "-t", str(args.threads or os.cpu_count() or 1), "--no-webui", *caches, *args.llama_server_arg,
    ]  # fmt: skip


def llama_server_system(args: argparse.Namespace, gguf_file: Path, longest: int) -> ServedSystem:
    def command(port: int) -> list[str]:
        return _llama_server_command(args, gguf_file, port, longest)

    # llama-server's OpenMP threads get the spin count its own users get, not the engine's.
    env = openmp.environment_without_engine_choice()
    return ServedSystem("llama-cpp", "", "bench", "/health", command, env)


def inflight_system(args: argparse.Namespace, model_dir: Path, num_kv_blocks: int) -> ServedSystem:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)

    def command(port: int) -> list[str]:
        return _inflight_command(args, model_dir, port, num_kv_blocks)

    return ServedSystem("inflight", "", "bench", "/ready", command, env)


def vllm_system(args: argparse.Namespace, model_dir: Path, longest: int, work: Path) -> ServedSystem:
    from inflight.bench.vllm_cpu import vllm_env

    def command(port: int) -> list[str]:
        return _vllm_command(args, model_dir, port, longest)

    return ServedSystem("vllm", "", "bench", "/health", command, vllm_env(work, args.threads))


def inflight_memory_bytes(args: argparse.Namespace, shape: ModelShape, num_kv_blocks: int) -> int:
    """What an inflight CPU server (or the offline engine) with the benchmark's settings holds: sizing's
    terms for each tensor-parallel rank (weights, oneDNN's packed copy, a step's activations, the runtime)
    and a pool of `num_kv_blocks` KV blocks. `--quantization auto` is planned like none (sizing's rule:
    it cannot see which of a GGUF file's tensors stay quantized), which can only overestimate."""
    limits = EngineLimits(
        block_size=BLOCK_SIZE, max_slots=args.max_slots, max_batched_tokens=args.max_num_batched_tokens
    )
    formats = Formats(args.dtype, args.quantization, args.kv_cache_dtype)
    ranks = args.tensor_parallel_size
    return ranks * engine_bytes(shape, formats, ranks, limits, on_gpu=False).total(num_kv_blocks * BLOCK_SIZE)


def memory_needs(
    args: argparse.Namespace,
    model_dir: Path,
    compare: list[str],
    gguf_file: Path | None,
    longest: int,
    num_kv_blocks: int,
) -> dict[str, int]:
    """Estimated bytes of each server the benchmark starts and of the offline engine (unless
    --skip-offline): inflight's from sizing, vLLM-CPU's from vllm_cpu.memory_bytes, llama-server's its
    GGUF file and its context's KV cache."""
    try:
        shape = shape_of_config(str(model_dir), ModelConfig.from_dir(model_dir))
    except ModelLoadError as error:
        raise SystemExit(str(error)) from error
    inflight = inflight_memory_bytes(args, shape, num_kv_blocks)
    needs = {"inflight": inflight}
    if compare == ["vllm"]:
        needs["vllm"] = vllm_cpu.memory_bytes(shape, args.dtype)
    if gguf_file is not None:
        context_kv = _llama_context(args, longest) * kv_bytes_per_token(shape, LLAMA_CPP_KV_DTYPE, 1)
        needs["llama-cpp"] = gguf_file.stat().st_size + context_kv
    if not args.skip_offline:
        needs["offline engine"] = inflight
    return needs


def choose_servers(requested: str, needs: dict[str, int], available: int | None) -> tuple[str, str]:
    """`--servers` as `together` or `one-at-a-time`, and why, in words with the figures. `auto`: together
    when everything that would hold memory at once (`needs`: each server's estimate and the offline
    engine's) fits in MEMORY_MARGIN of the `available` bytes (None: unknown, together as well)."""
    total = sum(needs.values())
    figures = ", ".join(f"{name} {size / GIB:.1f} GiB" for name, size in needs.items())
    estimate = f"about {total / GIB:.1f} GiB together ({figures})"
    if requested != "auto":
        return requested, f"--servers {requested}; the estimates: {estimate}"
    if len(needs) < 2:
        return TOGETHER, f"one thing holds memory at a time anyway ({figures})"
    if available is None:
        return TOGETHER, f"the memory available is unknown (no /proc/meminfo); the estimates: {estimate}"
    room = MEMORY_MARGIN * available
    within = f"{MEMORY_MARGIN:.0%} of the {available / GIB:.1f} GiB available (MemAvailable)"
    if total <= room:
        return TOGETHER, f"{estimate}, within {within}"
    why = (
        f"{estimate}, more than {within}: each server is started for its turn and stopped after it "
        "(--servers together keeps them all up)"
    )
    largest = max(needs, key=lambda name: needs[name])
    if needs[largest] > room:
        why += f"; even alone, {largest} needs more than that and may not start"
    return ONE_AT_A_TIME, why


class Servers:
    """The systems of a run and which of them hold memory. `together`: every server started once, the idle
    ones paused (SIGSTOP: an idle vLLM-CPU worker busy-polls); `one-at-a-time`: each started for its turn
    and stopped after it. A server is ready and warmed up before its turn is measured. `memory`: the mode,
    why, and the estimates it was chosen on, for the report."""

    def __init__(self, mode: str, memory: dict[str, Any], warm_up: Callable[[ServedSystem], None]) -> None:
        self.systems: list[ServedSystem] = []
        self.mode = mode
        self.memory = memory
        self._warm_up = warm_up

    def start(self) -> None:
        """`together`: start every server, wait until each is ready and warm each up (a --url server too)."""
        if self.mode != TOGETHER:
            return
        for system in self.systems:
            if system.command is not None:
                system.start()
        for system in self.systems:
            self._ready(system)

    def _ready(self, system: ServedSystem) -> None:
        if system.process is not None:
            wait_until_ready(f"{system.url}{system.ready_path}", system.process, system.name)
        self._warm_up(system)

    def round_order(self) -> list[ServedSystem]:
        """The order of a round's turns: one at a time, the server still up from the last turn goes first
        (one start fewer per round: A B, B A, ...), else the systems' order."""
        if self.mode == TOGETHER:
            return list(self.systems)
        return sorted(self.systems, key=lambda system: not system.running)

    def turn(self, system: ServedSystem) -> None:
        """Make `system` the one that runs: the others paused (together) or stopped (one at a time, before
        `system` starts)."""
        if self.mode == TOGETHER:
            for other in self.systems:
                if other is system:
                    other.resume()
                else:
                    other.pause()
            return
        for other in self.systems:
            if other is not system:
                other.stop()
        if not system.running:
            system.start()
            self._ready(system)

    def rest(self) -> None:
        """Every server paused (together) or stopped (one at a time): the offline engine's turn."""
        for system in self.systems:
            if self.mode == TOGETHER:
                system.pause()
            else:
                system.stop()

    def stop(self) -> None:
        for system in self.systems:
            system.stop()


def wait_until_ready(
    ready_url: str, process: subprocess.Popen[bytes] | None, name: str, timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Poll `ready_url` until it answers 200; SystemExit if `process` (the server, when this started it)
    exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(
                f"the {name} server exited with code {process.returncode} before it was ready "
                "(its log is above)"
            )
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the {name} server was not ready after {timeout_s:.0f} s")


def _offline_tokens_per_s(
    args: argparse.Namespace, model_dir: Path, inflight_model: Path, requests: list[BenchRequest]
) -> dict[str, Any]:
    import torch

    from inflight.bench.inflight_engine import CONTINUOUS, STATIC
    from inflight.bench.system import BenchSettings

    if args.threads:
        torch.set_num_threads(args.threads)

    settings = BenchSettings(
        model_dir=model_dir,
        requests=requests,
        max_slots=args.max_slots,
        dtype=args.dtype,
        vllm_python=None,
        max_num_batched_tokens=args.max_num_batched_tokens,
        threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        inflight_model=inflight_model,
    )
    run = (STATIC if args.scheduler == "static" else CONTINUOUS).run(settings)
    generated = sum(len(tokens) for tokens in run.outputs)
    return {
        "output_tokens": generated,
        "seconds": round(run.seconds, 3),
        "output_tokens_per_s": generated / run.seconds,
    }


def plot(report: dict[str, Any], results: dict[str, list[RequestResult]], path: Path) -> None:
    """TTFT CDF, ITL histogram and output tokens/s bars for every served system (and the offline engine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft_axis, itl_axis, bar_axis) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, system_results in results.items():
        ok = [r for r in system_results if r.error is None]
        ttfts = sorted(r.ttft * 1000 for r in ok if r.ttft is not None)
        ttft_axis.plot(
            ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], drawstyle="steps-post", label=name
        )
        itls = [gap * 1000 for r in ok for gap in r.itls]
        itl_axis.hist(itls, bins=50, alpha=0.6, label=name)
    ttft_axis.set(title="Time to first token (CDF)", xlabel="ms", ylabel="fraction of requests")
    itl_axis.set(title="Inter-token latency", xlabel="ms", ylabel="token gaps")
    ttft_axis.legend()
    itl_axis.legend()
    bars = {f"{name} served": report["systems"][name]["output_tokens_per_s"] for name in results}
    if report.get("offline"):
        bars["inflight offline"] = report["offline"]["output_tokens_per_s"]
    colors = ["tab:blue", "tab:orange", "tab:gray"]
    bar_axis.bar(list(bars), list(bars.values()), color=colors[: len(bars)])
    for i, value in enumerate(bars.values()):
        bar_axis.text(i, value, f"{value:.0f}", ha="center", va="bottom")
    ratio = report.get("ratio_served_to_offline")
    bar_axis.set(
        title="Output tokens/s" + (f" (served/offline = {ratio:.2f})" if ratio else ""), ylabel="tokens/s"
    )
    w = report["workload"]
    figure.suptitle(
        f"inflight bench serve: {w['num_requests']} {w['kind']} requests, {w['arrivals']}, "
        f"{sampling_name(w['temperature'], w['top_p'])}, "
        f"{w['model']} ({report['server'].get('dtype', '?')})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _median_round(
    rounds: list[tuple[dict[str, Any], list[RequestResult]]],
) -> tuple[dict[str, Any], list[RequestResult]]:
    """The round with the median output tokens/s (its latencies and requests), every round's rate listed."""
    rates = [summary["output_tokens_per_s"] for summary, _ in rounds]
    middle = sorted(range(len(rounds)), key=lambda i: rates[i])[len(rounds) // 2]
    summary, results = rounds[middle]
    summary = {**summary, "rounds_output_tokens_per_s": [round(rate, 1) for rate in rates]}
    summary["output_tokens_per_s"] = statistics.median(rates)
    return summary, results


def _ratios(inflight: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """inflight over `other`: throughput (higher is better); latencies and server CPU per token as
    inflight's / other's (lower is better)."""

    def over(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    return {
        "output_tokens_per_s": over(inflight["output_tokens_per_s"], other["output_tokens_per_s"]),
        "ttft_p50": over(inflight["ttft_ms"]["p50"], other["ttft_ms"]["p50"]),
        "itl_p50": over(inflight["itl_ms"]["p50"], other["itl_ms"]["p50"]),
        "itl_p99": over(inflight["itl_ms"]["p99"], other["itl_ms"]["p99"]),
        "tpot_p50": over(inflight["tpot_ms"]["p50"], other["tpot_ms"]["p50"]),
        "e2e_p50": over(inflight["e2e_ms"]["p50"], other["e2e_ms"]["p50"]),
        "server_cpu_per_output_token": over(
            inflight.get("server_cpu_us_per_output_token"), other.get("server_cpu_us_per_output_token")
        ),
    }


def parse_rates(text: str) -> list[float]:
    """`--request-rate`: comma-separated requests/s, `inf` = all at once (e.g. `inf,16`)."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        rates = []
    if not rates or min(rates) <= 0:
        raise SystemExit(f"--request-rate {text}: give rates > 0 separated by commas (inf = all at once)")
    return rates


def parse_loads(args: argparse.Namespace) -> list[Load]:
    """`--concurrency 1,4` (closed loops) if given, else `--request-rate`."""
    if not args.concurrency:
        return [Load(rate=rate) for rate in parse_rates(str(args.request_rate))]
    try:
        levels = [int(part) for part in str(args.concurrency).split(",") if part.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency {args.concurrency}: give client counts >= 1 separated by commas")
    return [Load(concurrency=level) for level in levels]


def run_serve_benchmark(args: argparse.Namespace) -> int:
    import tempfile

    from inflight.bench.checkpoint import bench_checkpoint, inflight_checkpoint

    loads = parse_loads(args)
    # One concrete dtype (the engine's `auto` rule on this CPU) for both servers and the offline engine.
    args.dtype = resolve_dtype_name(args.dtype, False, native_cpu_bfloat16=cpu_isa().native_bfloat16)
    if min(args.num_requests, args.rounds, args.threads or 1) < 1:
        raise SystemExit("--num-requests, --rounds and --threads must be >= 1")
    compare = [name for name in (args.compare or "").split(",") if name.strip()]
    if compare not in ([], ["vllm"], ["llama-cpp"]):
        raise SystemExit(f"--compare {args.compare}: compare with one system, `vllm` or `llama-cpp`")
    if compare and args.url:
        raise SystemExit("--compare starts both servers itself; it cannot be used with --url")
    if args.url and args.servers == ONE_AT_A_TIME:
        raise SystemExit("--servers one-at-a-time starts and stops the servers itself; not with --url")
    if compare == ["vllm"] and not (args.vllm_python.is_file() and os.access(args.vllm_python, os.X_OK)):
        raise SystemExit(
            f"--vllm-python {args.vllm_python} is not an executable Python; "
            "`make bench-vllm` creates .venv-vllm"
        )
    gguf_file = _llama_cpp_gguf(args) if compare == ["llama-cpp"] else None
    model_dir = bench_checkpoint(args.model)
    # inflight serves the GGUF file itself when its weights stay quantized, and always against llama.cpp
    # (the same file for both); vLLM reads the folder.
    inflight_model = gguf_file or inflight_checkpoint(args.model, model_dir, args.quantization)
    requests = with_sampling(
        load_workload(model_dir, args.num_requests, args.seed, args.workload, args.schema_share),
        args.temperature,
        args.top_p,
    )
    longest = longest_request(requests)
    num_kv_blocks = args.num_kv_blocks or kv_blocks_for(requests, args.max_slots)
    if args.url:
        needs: dict[str, int] = {}
        available = None
        mode, why = TOGETHER, "--url: the benchmark starts no server"
    else:
        needs = memory_needs(args, model_dir, compare, gguf_file, longest, num_kv_blocks)
        available = available_memory_bytes()
        mode, why = choose_servers(args.servers, needs, available)
    _say(f"servers {mode}: {why}")
    memory: dict[str, Any] = {
        "mode": mode,
        "requested": args.servers,
        "why": why,
        "estimated_gib": {name: round(size / GIB, 2) for name, size in needs.items()},
        "available_gib": None if available is None else round(available / GIB, 2),
    }
    # Untimed, like the offline runner's warm-up: two short requests through the HTTP path, on a prompt no
    # timed one shares a prefix with (llama-server keeps each slot's last prompt even without prefix caching),
    # sampled as the timed ones are.
    warmup = with_sampling(
        [BenchRequest(warmup_prompt(requests), WARMUP_TOKENS)] * 2, args.temperature, args.top_p
    )

    def warm_up(system: ServedSystem) -> None:
        asyncio.run(run_clients(system.url, system.model, warmup, math.inf, args.seed))

    failed = False
    servers = Servers(mode, memory, warm_up)
    # A SIGTERM unwinds like Ctrl-C does, through the `finally` that stops the servers.
    previous_handler = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="inflight-bench-serve-") as work:
        try:
            if args.url:
                url = args.url.rstrip("/")
                model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
                servers.systems.append(ServedSystem("inflight", url, model, "/ready"))
            else:
                servers.systems.append(inflight_system(args, inflight_model, num_kv_blocks))
            if compare == ["vllm"]:
                servers.systems.append(vllm_system(args, model_dir, longest, Path(work)))
            if gguf_file is not None:
                servers.systems.append(llama_server_system(args, gguf_file, longest))
            servers.start()
            for load in loads:
                report, results = _run_load(
                    args, load, servers, model_dir, inflight_model, requests, num_kv_blocks
                )
                stem = "serve" if len(loads) == 1 else f"serve-{load.name}"
                _write_report(report, results, args.out, stem)
                failed = failed or any(summary["failed"] for summary in report["systems"].values())
        finally:
            servers.stop()
            signal.signal(signal.SIGTERM, previous_handler)
    return 1 if failed else 0


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _llama_cpp_gguf(args: argparse.Namespace) -> Path:
    """The GGUF file llama-server and inflight serve for --compare llama-cpp; SystemExit with the fix."""
    from inflight.checkpoints.resolve import resolve_model
    from inflight.engine.gguf import is_gguf

    if args.llama_server is None or not (
        args.llama_server.is_file() and os.access(args.llama_server, os.X_OK)
    ):
        raise SystemExit(
            f"--llama-server {args.llama_server} is not an executable; `make llama-cpp` builds it "
            "(`benchmarks/llama_cpp.py path llama-server` prints its path)"
        )
    path = resolve_model(args.model)
    if not is_gguf(path):
        raise SystemExit(
            f"--compare llama-cpp needs a GGUF --model (a .gguf file or builtin:smollm2), not {path}"
        )
    return path


def _run_load(
    args: argparse.Namespace,
    load: Load,
    servers: Servers,
    model_dir: Path,
    inflight_model: Path,
    requests: list[BenchRequest],
    num_kv_blocks: int,
) -> tuple[dict[str, Any], dict[str, list[RequestResult]]]:
    """`args.rounds` rounds of `load` through every system (and the offline engine), alternating; a
    server's start and warm-up before its turn are not measured."""
    rounds: dict[str, list[tuple[dict[str, Any], list[RequestResult]]]] = {}
    offline_runs: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    for round_number in range(1, args.rounds + 1):
        # The systems (and the offline engine) alternate, so load drift affects all alike.
        for system in servers.round_order():
            servers.turn(system)
            _say(f"round {round_number}/{args.rounds}: {len(requests)} streaming requests, "
                 f"{load.describe()}, against {system.name} at {system.url}")  # fmt: skip
            server_before, client_before = system.cpu_seconds(), time.process_time()
            results, duration = asyncio.run(
                run_clients(system.url, system.model, requests, load.rate, args.seed, load.concurrency)
            )
            summary = summarize(results, duration)
            # The server's resident memory after the round (weights, KV pool, runtime), all its processes
            # (vLLM-CPU's engine core holds its weights and KV cache, not its API server); None for --url.
            summary["server_rss_mib"] = (
                process_group_resident_mib(system.process.pid) if system.process is not None else None
            )
            client_cpu = time.process_time() - client_before
            server_after = system.cpu_seconds()
            server_cpu = (
                None if server_before is None or server_after is None else server_after - server_before
            )
            # Both share the machine with the engine: CPU they use is CPU its threads wait for.
            summary["server_cpu_us_per_output_token"] = cpu_per_output_token(
                server_cpu, summary["output_tokens"]
            )
            summary["client_cpu_us_per_output_token"] = cpu_per_output_token(
                client_cpu, summary["output_tokens"]
            )
            _say(
                f"{system.name}: {summary['completed']}/{summary['requests']} ok in "
                f"{summary['duration_s']} s, {summary['output_tokens_per_s']:.1f} output tokens/s, "
                f"TTFT p50 {summary['ttft_ms']['p50']} ms, ITL p50 {summary['itl_ms']['p50']} ms, "
                f"TPOT p50 {summary['tpot_ms']['p50']} ms; server RSS {summary['server_rss_mib']} MiB; "
                f"CPU per output token: server "
                f"{summary['server_cpu_us_per_output_token']} us, "
                f"client {summary['client_cpu_us_per_output_token']} us"
            )
            rounds.setdefault(system.name, []).append((summary, results))
        if not args.skip_offline:
            servers.rest()
            _say("the same workload through the offline engine (same engine settings)")
            offline_runs.append(_offline_tokens_per_s(args, model_dir, inflight_model, requests))
            _say(f"offline: {offline_runs[-1]['output_tokens_per_s']:.1f} output tokens/s")
    medians = {name: _median_round(system_rounds) for name, system_rounds in rounds.items()}
    summaries = {name: summary for name, (summary, _) in medians.items()}
    median_results = {name: results for name, (_, results) in medians.items()}
    served = summaries["inflight"]
    offline = None
    if offline_runs:
        offline_rates = [run["output_tokens_per_s"] for run in offline_runs]
        offline = {
            "output_tokens_per_s": statistics.median(offline_rates),
            "rounds_output_tokens_per_s": [round(r, 1) for r in offline_rates],
            "seconds": [run["seconds"] for run in offline_runs],
        }
    report: dict[str, Any] = {
        "workload": {
            "model": args.model,
            "model_dir": str(model_dir),
            "num_requests": len(requests),
            "seed": args.seed,
            "kind": args.workload,
            "request_rate": load.rate,
            "concurrency": load.concurrency,
            "arrivals": load.describe(),
            "rounds": args.rounds,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "output_tokens": sum(r.output_len for r in requests),
            "temperature": args.temperature,
            "top_p": args.top_p,
            "sampling": (
                f"{sampling_name(args.temperature, args.top_p)}, ignore_eos, "
                "streaming /v1/completions with token-id prompts"
            ),
        },
        "server": {
            "url": args.url or "started by the benchmark",
            "dtype": args.dtype,
            "kv_cache_dtype": args.kv_cache_dtype,
            "quantization": args.quantization,
            "model": str(inflight_model),
            "max_slots": args.max_slots,
            "num_kv_blocks": num_kv_blocks,
            "block_size": BLOCK_SIZE,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "scheduler": args.scheduler,
            "max_merged_prefill_tokens": args.max_merged_prefill_tokens,
            "max_prefill_tokens_while_decoding": args.max_prefill_tokens_while_decoding or "engine default",
            "enable_prefix_caching": args.enable_prefix_caching,
            "threads": args.threads or "torch default",
        },
        "servers": servers.memory,
        "environment": {
            "cpus": os.cpu_count(),
            "cpu": cpu_isa().describe(),
            "python": sys.version.split()[0],
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "served": served,
        "systems": summaries,
        "offline": offline,
        "ratio_served_to_offline": (served["output_tokens_per_s"] / offline["output_tokens_per_s"])
        if offline
        else None,
        "ratio_inflight_to_vllm": _ratios(served, summaries["vllm"]) if "vllm" in summaries else None,
        "ratio_inflight_to_llama_cpp": (
            _ratios(served, summaries["llama-cpp"]) if "llama-cpp" in summaries else None
        ),
        "requests": {
            name: [asdict(r) | {"itls": [round(g, 5) for g in r.itls]} for r in results]
            for name, results in median_results.items()
        },
    }
    return report, median_results


def _write_report(
    report: dict[str, Any], results: dict[str, list[RequestResult]], out: Path, stem: str
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, results, png_path)
    if report["ratio_served_to_offline"] is not None:
        _say(f"served / offline output tokens/s = {report['ratio_served_to_offline']:.2f}")
    if report["ratio_inflight_to_vllm"] is not None:
        _say(f"inflight / vLLM: {report['ratio_inflight_to_vllm']}")
    if report["ratio_inflight_to_llama_cpp"] is not None:
        _say(f"inflight / llama.cpp: {report['ratio_inflight_to_llama_cpp']}")
    _say(f"wrote {json_path} and {png_path}")
