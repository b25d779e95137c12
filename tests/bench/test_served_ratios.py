"""The served benchmark's ratios of inflight to another server, from the requests each delivered."""

from __future__ import annotations

import pytest

from inflight.bench.served import RequestResult, _ratios, summarize


def _request(ttft: float, itls: list[float]) -> RequestResult:
    """One completed request of len(itls) + 1 output tokens, started at 0."""
    return RequestResult(
        prompt_tokens=100,
        output_tokens=len(itls) + 1,
        expected_output_tokens=len(itls) + 1,
        start=0.0,
        ttft=ttft,
        e2e=ttft + sum(itls),
        itls=itls,
    )


def test_the_ratios_show_a_sooner_finish_beside_a_slower_tpot() -> None:
    """A server that gives the first token early and then interleaves other prompts' prefill with the
    decodes (TPOT higher) can still finish every request sooner: the request latency (e2e) ratio says so
    where TTFT and TPOT point opposite ways."""
    stalled, steady = [0.5, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]
    interleaving = summarize([_request(1.0, stalled), _request(2.0, stalled)], 10.0)
    prefill_first = summarize([_request(4.0, steady), _request(4.0, steady)], 10.0)

    ratios = _ratios(interleaving, prefill_first)

    assert ratios["ttft_p50"] == pytest.approx(1.5 / 4.0, abs=1e-3)
    assert ratios["tpot_p50"] == pytest.approx(0.2 / 0.1, abs=1e-3)
    assert ratios["e2e_p50"] == pytest.approx(2.3 / 4.4, abs=1e-3)
    assert ratios["output_tokens_per_s"] == pytest.approx(1.0)


def test_a_latency_the_other_server_did_not_report_gives_no_ratio() -> None:
    """No completed request on the other side: its latencies are None and so are the ratios, not a crash."""
    done = summarize([_request(1.0, [0.1, 0.1])], 5.0)
    failed = summarize([RequestResult(100, 0, 3, 0.0, error="HTTP 500")], 5.0)

    ratios = _ratios(done, failed)

    assert ratios["e2e_p50"] is None
    assert ratios["ttft_p50"] is None
    assert ratios["output_tokens_per_s"] is None
