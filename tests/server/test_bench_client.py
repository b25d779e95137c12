"""The served benchmark's HTTP client against a live server: exact token counts, TTFT and gaps per token."""

from __future__ import annotations

import asyncio
from typing import Any

from inflight.bench.served import percentile, run_clients, summarize
from inflight.bench.workload import BenchRequest


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


def test_a_rejected_request_is_reported_not_counted(live: Any) -> None:
    too_long = [BenchRequest([7] * 10, output_len=1000)]  # beyond the test server's context
    results, duration = asyncio.run(run_clients(live.url, "tiny", too_long, float("inf"), seed=0))
    assert results[0].error is not None and "HTTP 400" in results[0].error
    assert summarize(results, duration)["failed"] == 1


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
