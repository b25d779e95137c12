"""Huge pages under the memory a CPU engine streams (engine/cpu/huge_pages.py): which pages are asked for,
what the kernel reports for them afterwards (/proc/self/smaps), and the log line of what it refused."""

from __future__ import annotations

import errno
import logging
import platform
from pathlib import Path

import pytest
import torch
from engine.test_decode_layer import _config, _model

from inflight.engine.cpu import huge_pages
from inflight.engine.cpu.huge_pages import HUGE_PAGE_BYTES
from inflight.engine.cpu.linear import prepare_linears, streamed_weights
from inflight.engine.cpu.quantized import QuantizedLinear
from inflight.engine.runner import allocate_kv_caches

THP = huge_pages.thp_mode()
needs_thp = pytest.mark.skipif(
    platform.system() != "Linux" or THP in (None, "never"), reason="no transparent huge pages here"
)


def _mappings() -> list[tuple[int, int, dict[str, str]]]:
    """/proc/self/smaps: (start, end, fields) of each mapping."""
    found: list[tuple[int, int, dict[str, str]]] = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            found.append((start, end, {}))
        elif found:
            name, _, value = line.partition(":")
            found[-1][2][name] = value.strip()
    return found


def _overlapping(t: torch.Tensor) -> list[dict[str, str]]:
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    return [fields for lo, hi, fields in _mappings() if lo < end and hi > start]


def test_the_pages_asked_for_are_the_huge_pages_a_tensors_bytes_lie_in() -> None:
    buffer = torch.empty(3 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    first = -(-buffer.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    offset = first - buffer.data_ptr()
    # One byte before a page boundary and one after: two pages; a whole page: one; beside it: shared once.
    straddling = buffer[offset - 1 : offset + 1]
    whole = buffer[offset : offset + HUGE_PAGE_BYTES]
    assert huge_pages.enclosing_pages([straddling]) == [first - HUGE_PAGE_BYTES, first]
    assert huge_pages.enclosing_pages([whole]) == [first]
    assert huge_pages.enclosing_pages([whole, straddling, whole]) == [first - HUGE_PAGE_BYTES, first]
    assert huge_pages.enclosing_pages([buffer[:0], torch.empty(4, device="meta")]) == []


def test_the_thp_mode_is_the_selected_word(tmp_path: Path) -> None:
    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")
    assert huge_pages.thp_mode(enabled) == "madvise"
    enabled.write_text("[never]\n")
    assert huge_pages.thp_mode(enabled) == "never"
    assert huge_pages.thp_mode(tmp_path / "missing") is None


@needs_thp
def test_collapsed_pages_are_huge_in_the_kernels_accounts_and_keep_their_contents() -> None:
    values = torch.arange(5 * HUGE_PAGE_BYTES // 4, dtype=torch.int32)
    expected = values.clone()
    collapsed, refused = huge_pages.collapse([values])
    assert collapsed + HUGE_PAGE_BYTES * sum(refused.values()) >= 4 * HUGE_PAGE_BYTES
    assert torch.equal(values, expected)
    mappings = _overlapping(values)
    assert all("hg" in fields["VmFlags"].split() for fields in mappings)
    huge_kib = sum(int(fields["AnonHugePages"].split()[0]) for fields in mappings)
    assert huge_kib * 1024 >= collapsed


@needs_thp
def test_a_cpu_kv_cache_is_one_zeroed_allocation_from_a_huge_page_on_advised_pages() -> None:
    caches = allocate_kv_caches(_config(False, None), 1024, 16, torch.float32, "cpu")
    first = caches[0][0]
    assert first.data_ptr() % HUGE_PAGE_BYTES == 0
    layer_bytes = 2 * first.numel() * first.element_size()
    for i, pair in enumerate(caches):
        for j, cache in enumerate(pair):
            assert cache.data_ptr() == first.data_ptr() + i * layer_bytes + j * layer_bytes // 2
            assert cache.is_contiguous() and cache.count_nonzero() == 0
            assert all("hg" in fields["VmFlags"].split() for fields in _overlapping(cache))


def test_the_log_line_counts_the_pages_refused_by_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    answers = {huge_pages.MADV_COLLAPSE: [0, errno.EINVAL, errno.EAGAIN, errno.EINVAL, errno.ENOMEM]}
    monkeypatch.setattr(huge_pages, "_pages", lambda tensors: [HUGE_PAGE_BYTES * i for i in range(5)])
    monkeypatch.setattr(
        huge_pages, "_madvise", lambda page, advice: answers.get(advice, [0] * 5)[page // HUGE_PAGE_BYTES]
    )
    with caplog.at_level(logging.INFO, logger="inflight.engine"):
        huge_pages.hold_on_huge_pages([], "weights")
    assert "huge pages: 2 MiB of weights in" in caplog.text
    assert "(3 pages refused: EAGAIN 1, EINVAL 2)" in caplog.text


@needs_thp
def test_a_prepared_model_holds_the_weights_its_kernels_stream_on_advised_pages() -> None:
    model = _model("q8_0", torch.float32, False, None)
    prepare_linears(model, max_batch_size=2)
    weights = streamed_weights(model)
    quantized = [m.weight for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(w.interleaved_rows is not None for w in quantized)
    assert {t.data_ptr() for w in quantized for t in (w.qweight, w.scales)} <= {t.data_ptr() for t in weights}
    assert model.embed_tokens.weight.data_ptr() in {t.data_ptr() for t in weights}
    for t in weights:
        assert all("hg" in fields["VmFlags"].split() for fields in _overlapping(t))
