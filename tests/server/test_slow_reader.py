"""A client that stops reading a stream costs the server memory in proportion to its output, not more.

The engine sends deltas; what the client has not read yet is merged into one pending delta per request,
so an unread n=8 stream with logprobs holds about its output once (not one cumulative copy per step).
"""

from __future__ import annotations

import gc
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

MAX_TOKENS = 2000
N = 8
LOGPROBS = 5
# Memory the output may take while unread, per generated token: LOGPROBS + 1 candidates of ~400 bytes
# each in memory (a Logprob object, its decoded text, a dict slot), with room for allocator overhead.
# One copy per step instead (the old contract) grows with the square of the length: ~350 MiB here.
BYTES_PER_TOKEN = (LOGPROBS + 1) * 1024


@pytest.fixture(scope="module")
def roomy(tiny_llama_dir: Path, start_server_factory: Any) -> Iterator[Any]:
    """A server where 8 sequences of 2000 tokens fit at once."""
    server = start_server_factory(tiny_llama_dir, max_slots=N, num_kv_blocks=1100, max_model_len=2048)
    yield server
    server.stop()


def test_a_stream_nobody_reads_holds_its_output_once(roomy: Any, wait_for: Any) -> None:
    body = {
        "model": "tiny",
        "prompt": "x",
        "max_tokens": MAX_TOKENS,
        "n": N,
        "logprobs": LOGPROBS,
        "ignore_eos": True,
        "stream": True,
    }
    payload = json.dumps(body)
    host, port = roomy.url.removeprefix("http://").split(":")
    process = psutil.Process()
    before = roomy.engine.stats()
    gc.collect()
    rss_before = process.memory_info().rss
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel buffers little of it
    try:
        sock.connect((host, int(port)))
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n{payload}".encode()
        )
        # Never read: wait until the engine generated every token (the server holds what was not sent).
        generated = N * MAX_TOKENS
        wait_for(
            lambda: (
                (s := roomy.engine.stats()).num_generation_tokens - before.num_generation_tokens >= generated
                and s.num_running == 0
            ),
            "the engine to generate every token",
            timeout=600,
        )
        gc.collect()
        growth = process.memory_info().rss - rss_before
    finally:
        sock.close()
    bound = generated * BYTES_PER_TOKEN
    print(f"RSS growth with an unread n={N} stream of {MAX_TOKENS} tokens: {growth / 2**20:.1f} MiB")
    assert growth < bound, f"RSS grew {growth / 2**20:.1f} MiB, more than {bound / 2**20:.1f} MiB"
    wait_for(lambda: roomy.engine.num_in_flight == 0, "the server to drop the request")
