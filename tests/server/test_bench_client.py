"""The served benchmark's HTTP client against a live server: exact token counts, TTFT and gaps per token."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from inflight.bench.served import (
    RequestResult,
    _inflight_command,
    _llama_server_command,
    _vllm_command,
    cpu_per_output_token,
    parse_loads,
    percentile,
    process_group_cpu_seconds,
    process_group_resident_mib,
    run_clients,
    summarize,
    time_per_output_token,
)
from inflight.bench.system import resident_mib
from inflight.bench.workload import BenchRequest, with_sampling


def test_the_benchmark_client_measures_every_token(live: Any) -> None:
    requests = [BenchRequest([5 + i, 17, 42, 99], output_len=3 + i) for i in range(4)]
    results, duration = asyncio.run(run_clients(live.url, "tiny", requests, float("inf"), seed=0))
    assert [r.error for r in results] == [None] * 4
    assert [r.output_tokens for r in results] == [3, 4, 5, 6]
    assert all(r.ttft is not None and r.ttft > 0 for r in results)
    # One streamed chunk per engine step (one token), or fewer when the server merged steps a slow
    # consumer had not read yet: a gap per chunk after the first.
    assert all(1 <= len(r.itls) + 1 <= r.output_tokens for r in results)
    summary = summarize(results, duration)
    assert summary["completed"] == 4 and summary["output_tokens"] == 18
    assert summary["output_tokens_per_s"] == 18 / duration
    assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
    assert 0 < summary["tpot_ms"]["p50"] <= summary["tpot_ms"]["p99"]


def test_closed_loop_clients_never_have_more_requests_in_flight(live: Any) -> None:
    requests = [BenchRequest([5 + i, 17, 42], output_len=4) for i in range(5)]
    for concurrency in (1, 2):
        results, _ = asyncio.run(run_clients(live.url, "tiny", requests, float("inf"), 0, concurrency))
        assert [r.error for r in results] == [None] * 5
        spans = [(r.start, r.start + (r.e2e or 0.0)) for r in results]
        for start, _end in spans:
            in_flight = sum(1 for s, e in spans if s <= start < e)
            assert in_flight <= concurrency
        if concurrency == 1:  # one after the other: each starts once the one before it has ended
            ordered = sorted(spans)
            assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(ordered))


def test_loads_are_concurrency_levels_or_rates() -> None:
    from inflight.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--concurrency", "1,4"])
    assert [load.name for load in parse_loads(args)] == ["concurrency-1", "concurrency-4"]
    args = build_parser().parse_args(["bench", "serve", "--request-rate", "inf,16"])
    assert [load.name for load in parse_loads(args)] == ["all-at-once", "poisson-16"]
    with pytest.raises(SystemExit, match="--concurrency 0"):
        parse_loads(build_parser().parse_args(["bench", "serve", "--concurrency", "0"]))


def test_a_rejected_request_is_reported_not_counted(live: Any) -> None:
    too_long = [BenchRequest([7] * 10, output_len=1000)]  # beyond the test server's context
    results, duration = asyncio.run(run_clients(live.url, "tiny", too_long, float("inf"), seed=0))
    assert results[0].error is not None and "HTTP 400" in results[0].error
    assert summarize(results, duration)["failed"] == 1


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0


def test_tpot_does_not_depend_on_how_tokens_are_packed_into_chunks() -> None:
    # Five tokens: the first at 0.1 s, the other four 40 ms later, either merged into one chunk or sent
    # as a burst of four one-token chunks. ITL (gaps between chunks) differs; TPOT is 10 ms in both.
    merged = RequestResult(4, 5, 5, start=0.0, ttft=0.1, e2e=0.14, itls=[0.04])
    burst = RequestResult(4, 5, 5, start=0.0, ttft=0.1, e2e=0.14, itls=[0.04, 0.0, 0.0, 0.0])
    assert time_per_output_token(merged) == time_per_output_token(burst) == pytest.approx(0.01)
    summaries = [summarize([result], 1.0) for result in (merged, burst)]
    assert summaries[0]["tpot_ms"] == summaries[1]["tpot_ms"] == {"p50": 10.0, "p99": 10.0}
    assert summaries[0]["itl_ms"]["p50"] == 40.0 and summaries[1]["itl_ms"]["p50"] == 0.0


def test_bench_serve_runs_every_round_cold_on_both_servers(tmp_path: Path) -> None:
    """The workload shares no prefixes: with prefix caching a round after the first would find its prompts
    cached by the round before and skip their prefill, so bench serve turns caching off on both servers
    (`inflight serve` keeps it on by default)."""
    from inflight.cli import build_parser

    args = build_parser().parse_args(["bench", "serve"])
    assert args.enable_prefix_caching is False
    assert build_parser().parse_args(["serve", "--model", "m"]).enable_prefix_caching is True
    assert "--no-enable-prefix-caching" in _inflight_command(args, tmp_path, 8000, 100)
    assert "--no-enable-prefix-caching" in _vllm_command(args, tmp_path, 8001, 300)
    cached = build_parser().parse_args(["bench", "serve", "--enable-prefix-caching"])
    assert "--enable-prefix-caching" in _vllm_command(cached, tmp_path, 8001, 300)
    assert "--no-enable-prefix-caching" not in _inflight_command(cached, tmp_path, 8000, 100)


def test_bench_serve_hands_speculative_decoding_to_the_server(tmp_path: Path) -> None:
    from inflight.cli import build_parser

    assert "--speculative" not in _inflight_command(
        build_parser().parse_args(["bench", "serve"]), tmp_path, 1, 9
    )
    args = build_parser().parse_args(
        ["bench", "serve", "--speculative", "ngram", "--num-speculative-tokens", "3"]
    )
    command = " ".join(_inflight_command(args, tmp_path, 8000, 100))
    assert "--speculative ngram --num-speculative-tokens 3 --ngram-min 2" in command


def test_bench_serve_hands_the_prefill_merge_limit_to_the_server(tmp_path: Path) -> None:
    from inflight.cli import build_parser
    from inflight.engine.cli_args import engine_config_from_args

    args = build_parser().parse_args(["bench", "serve", "--max-merged-prefill-tokens", "0"])
    command = _inflight_command(args, tmp_path, 8000, 100)
    served = build_parser().parse_args(command[command.index("serve") :])
    assert engine_config_from_args(served).max_merged_prefill_tokens == 0


def test_bench_serve_hands_the_prefill_cap_while_decoding_to_the_server_when_given(tmp_path: Path) -> None:
    from inflight.cli import build_parser
    from inflight.engine.cli_args import engine_config_from_args

    def served_config(*flags: str) -> int | None:
        args = build_parser().parse_args(["bench", "serve", *flags])
        command = _inflight_command(args, tmp_path, 8000, 100)
        served = build_parser().parse_args(command[command.index("serve") :])
        return engine_config_from_args(served).max_prefill_tokens_while_decoding

    assert served_config("--max-prefill-tokens-while-decoding", "1024") == 1024
    assert served_config() is None


@contextmanager
def group_of_parent_and_child(child_script: str, ready: bytes) -> Iterator[int]:
    """A parent process in a session (process group) of its own, waiting, whose child runs `child_script`;
    yields the parent's pid once the child printed the line `ready` (its work done), then kills the group."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child_script!r}]); "
            "time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline() == ready
        yield parent.pid
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


# The child burns 0.4 s of CPU and the test asks for 0.3: /proc counts whole clock ticks (1/100 s) and may
# show a process that burnt exactly 0.3 s as 0.29.
BURN_THEN_WAIT = """
import sys, time
while time.process_time() < 0.4:
    pass
print("burnt", flush=True)
time.sleep(120)
"""


def test_a_servers_cpu_counts_every_process_of_its_group() -> None:
    """The CPU a server used is its process group's: vLLM's API server leaves the work to the engine core
    and worker processes it starts, as this parent leaves it to its child."""
    with group_of_parent_and_child(BURN_THEN_WAIT, b"burnt\n") as parent:
        used = process_group_cpu_seconds(parent)
        assert used is not None and used >= 0.3
        assert process_group_cpu_seconds(os.getpgid(0)) != used  # another group: not this one's
    assert cpu_per_output_token(0.5, 1000) == 500.0
    assert cpu_per_output_token(None, 1000) is None and cpu_per_output_token(0.5, 0) is None


HOLD_THEN_WAIT = """
import time
held = bytearray(200 * 2**20)
held[:: 4096] = b"x" * len(held[:: 4096])
print("held", flush=True)
time.sleep(120)
"""


def test_a_servers_resident_memory_counts_every_process_of_its_group() -> None:
    """A server's resident memory is its process group's: vLLM-CPU's weights and KV cache live in its
    engine core, a child of the API server, as these 200 MiB live in this parent's child."""
    with group_of_parent_and_child(HOLD_THEN_WAIT, b"held\n") as parent:
        group = process_group_resident_mib(parent)
        parent_alone = resident_mib(parent)
        assert group is not None and parent_alone is not None
        assert group - parent_alone >= 200


def test_bench_passes_the_kv_cache_dtype_to_both_servers_and_the_offline_engines(tmp_path: Path) -> None:
    from inflight.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--kv-cache-dtype", "fp8"])
    for command in (_inflight_command(args, tmp_path, 8000, 100), _vllm_command(args, tmp_path, 8001, 300)):
        assert command[command.index("--kv-cache-dtype") + 1] == "fp8"
    assert build_parser().parse_args(["bench", "offline", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"


def serve_events(events: list[bytes], bodies: list[dict[str, Any]] | None = None) -> Any:
    """A one-route SSE server that streams `events` (each a `data:` payload) as chunked HTTP, and appends
    each request's JSON body to `bodies` when given."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        body = await reader.readexactly(length)
        if bodies is not None:
            bodies.append(json.loads(body))
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for event in events:
            data = b"data: " + event + b"\n\n"
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return handle


@pytest.mark.parametrize(
    ("last_text", "tokens"),
    [(b"", 2), (b"c", 3)],
    ids=["empty last chunk", "last chunk with a token"],
)
def test_the_client_reads_usage_from_llama_servers_last_chunk(last_text: bytes, tokens: int) -> None:
    """llama-server's streamed completion carries `usage` in its last chunk beside the finish reason
    (no separate `"choices":[]` chunk like OpenAI's and vLLM's)."""
    events = [
        b'{"choices":[{"text":"a","index":0,"finish_reason":null}],"object":"text_completion"}',
        b'{"choices":[{"text":"b","index":0,"finish_reason":null}],"object":"text_completion"}',
        b'{"choices":[{"text":"' + last_text + b'","index":0,"finish_reason":"length"}],'
        b'"usage":{"completion_tokens":' + str(tokens).encode() + b',"prompt_tokens":2,"total_tokens":5}}',
        b"[DONE]",
    ]

    async def run() -> list[RequestResult]:
        server = await asyncio.start_server(serve_events(events), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            requests = [BenchRequest([1, 2], output_len=tokens)]
            results, _ = await run_clients(
                f"http://127.0.0.1:{port}", "bench", requests, float("inf"), seed=0
            )
        return results

    (result,) = asyncio.run(run())
    assert result.error is None
    assert result.output_tokens == tokens
    assert len(result.itls) + 1 == tokens  # a token per chunk that carries text


def test_the_client_sends_each_requests_sampling() -> None:
    """Every server gets the same sampling (`bench serve --temperature --top-p`); greedy unless asked."""
    events = [b'{"choices":[{"text":"a","index":0,"finish_reason":"length"}]}', b'{"choices":[],'
              b'"usage":{"completion_tokens":1,"prompt_tokens":2,"total_tokens":3}}', b"[DONE]"]  # fmt: skip
    bodies: list[dict[str, Any]] = []

    async def run() -> list[RequestResult]:
        server = await asyncio.start_server(serve_events(events, bodies), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        greedy = [BenchRequest([1, 2], output_len=1)]
        async with server:
            sent = [
                await run_clients(f"http://127.0.0.1:{port}", "bench", requests, float("inf"), seed=0)
                for requests in (greedy, with_sampling(greedy, 0.7, 0.9))
            ]
        return [result for results, _ in sent for result in results]

    assert [result.error for result in asyncio.run(run())] == [None, None]
    assert [(body["temperature"], body["top_p"]) for body in bodies] == [(0.0, 1.0), (0.7, 0.9)]
    # Sampled: no server's own top_k or min_p default narrows the distribution (llama-server's are 40, 0.05).
    assert "top_k" not in bodies[0] and (bodies[1]["top_k"], bodies[1]["min_p"]) == (0, 0.0)
    assert all(body["ignore_eos"] and body["stream"] for body in bodies)


def test_bench_serve_refuses_sampling_outside_the_apis_ranges(capsys: pytest.CaptureFixture[str]) -> None:
    from inflight.cli import build_parser

    for flags, message in (
        (["--temperature", "2.5"], "--temperature: the temperature must be between 0 and 2, got 2.5"),
        (["--top-p", "0"], "--top-p: top_p must be above 0 and at most 1, got 0"),
        (["--schema-share", "1.5"], "--schema-share: the schema share must be in [0, 1], got 1.5"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "serve", *flags])
        assert message in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "serve", "--temperature", "0.8", "--top-p", "0.95"])
    assert (args.temperature, args.top_p) == (0.8, 0.95)


def test_llama_server_gets_a_slot_per_request_in_flight(tmp_path: Path) -> None:
    from inflight.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "serve", "--compare", "llama-cpp", "--llama-server", "/opt/llama-server", "--threads", "2"]
    )
    command = _llama_server_command(args, tmp_path / "m.gguf", 8002, 300)
    assert command[0] == "/opt/llama-server"
    flags = dict(zip(command[1::2], command[2::2], strict=False))
    assert flags["-m"] == str(tmp_path / "m.gguf") and flags["--port"] == "8002" and flags["-a"] == "bench"
    # -c is the context of all slots together: each of the max_slots slots holds the longest request.
    assert flags["-np"] == str(args.max_slots) and flags["-c"] == str(args.max_slots * 300)
    assert flags["-t"] == "2"
    assert "--no-repack" not in command
    # Every round cold, as on the other servers: no prompt kept in a slot or in host memory between requests.
    assert command[command.index("--cache-ram") + 1] == "0" and "--no-cache-prompt" in command
    cached = build_parser().parse_args(
        ["bench", "serve", "--compare", "llama-cpp", "--llama-server", "/opt/llama-server",
         "--enable-prefix-caching"]
    )  # fmt: skip
    command = _llama_server_command(cached, tmp_path / "m.gguf", 8002, 300)
    assert "--cache-ram" not in command and "--no-cache-prompt" not in command


def test_llama_server_gets_the_extra_arguments_after_the_benchmarks_own(tmp_path: Path) -> None:
    """--llama-server-arg, repeated, e.g. --no-repack where llama.cpp's repacking of Q4_1 crashes."""
    from inflight.cli import build_parser

    extra = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--compare",
            "llama-cpp",
            "--llama-server-arg=--no-repack",
            "--llama-server-arg=-fa",
        ]
    )
    assert _llama_server_command(extra, tmp_path / "m.gguf", 8002, 300)[-2:] == ["--no-repack", "-fa"]
