"""Run-time detection of native bfloat16 (cpu/isa.py) and the `auto` dtype that follows from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inflight.engine.cpu import isa
from inflight.engine.dtypes import DTYPE_NAMES, resolve_dtype_name


def _probe(capabilities: dict[str, Any] | None) -> Any:
    class Probe:
        @staticmethod
        def _get_cpu_capability() -> dict[str, Any]:
            if capabilities is None:
                raise RuntimeError("no probe")
            return capabilities

    return Probe


@pytest.mark.parametrize(
    ("avx512_bf16", "amx_bf16", "native", "described"),
    [
        (True, False, True, "bfloat16 native (avx512_bf16)"),
        (False, True, True, "bfloat16 native (amx_bf16)"),
        (True, True, True, "bfloat16 native (avx512_bf16, amx_bf16)"),
        (False, False, False, "bfloat16 not native (emulated)"),
    ],
)
def test_torch_probe_decides(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx_bf16: bool, native: bool, described: str
) -> None:
    probe = _probe({"avx512_bf16": avx512_bf16, "amx_bf16": amx_bf16, "cpu_name": "Probe CPU"})
    monkeypatch.setattr(torch._C, "_cpu", probe, raising=False)
    monkeypatch.setattr(isa, "proc_cpuinfo", lambda: ("", set()))
    found = isa.detect()
    assert (found.avx512_bf16, found.amx_bf16, found.native_bfloat16) == (avx512_bf16, amx_bf16, native)
    assert found.describe() == f"Probe CPU: {described}"


@pytest.mark.parametrize("probe", [None, "raises"])
def test_proc_cpuinfo_when_torch_cannot_tell(monkeypatch: pytest.MonkeyPatch, probe: str | None) -> None:
    monkeypatch.setattr(torch._C, "_cpu", None if probe is None else _probe(None), raising=False)
    monkeypatch.setattr(isa, "proc_cpuinfo", lambda: ("Some Xeon", {"avx512f", "amx_bf16", "amx_tile"}))
    found = isa.detect()
    assert found == isa.CpuIsa(name="Some Xeon", avx512_bf16=False, amx_bf16=True)
    assert found.native_bfloat16


def test_proc_cpuinfo_parses_this_machine() -> None:
    name, flags = isa.proc_cpuinfo()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        assert (name, flags) == ("", set())
        return
    if "flags" in text:
        assert flags and all(flag in text for flag in flags)
        # The two sources agree on this machine (torch's probe, when it has one, and the kernel's flags).
        found = isa.detect()
        assert found.avx512_bf16 == ("avx512_bf16" in flags)


@pytest.mark.parametrize(
    ("on_cuda", "native", "expected"),
    [
        (False, False, "float32"),
        (False, True, "bfloat16"),
        (True, False, "bfloat16"),
        (True, True, "bfloat16"),
    ],
)
def test_auto_dtype_is_bfloat16_only_where_native(on_cuda: bool, native: bool, expected: str) -> None:
    assert resolve_dtype_name("auto", on_cuda, native_cpu_bfloat16=native) == expected
    for name in DTYPE_NAMES:  # an explicit choice is kept
        assert resolve_dtype_name(name, on_cuda, native_cpu_bfloat16=native) == name
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        resolve_dtype_name("fp8", on_cuda, native_cpu_bfloat16=native)


@pytest.mark.parametrize("native", [False, True])
def test_engine_resolves_auto_from_the_cpu(
    monkeypatch: pytest.MonkeyPatch, native: bool, tiny_llama_dir: Path
) -> None:
    from inflight.engine import engine as engine_module
    from inflight.engine.config import EngineConfig

    monkeypatch.setattr(engine_module, "cpu_isa", lambda: isa.CpuIsa("test CPU", native, False))
    engine = engine_module.LLMEngine(tiny_llama_dir, EngineConfig(device="cpu", num_kv_blocks=16))
    assert engine.dtype == (torch.bfloat16 if native else torch.float32)
    assert engine.model.embed_tokens.weight.dtype == engine.dtype
