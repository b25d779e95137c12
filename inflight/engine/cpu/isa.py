"""What this CPU can do natively, detected at run time: the one place that answers "is bfloat16 native?".

bfloat16 arithmetic is native on x86 with AVX512-BF16 (AMD Zen 4+, Intel Cooper Lake / Sapphire Rapids)
or AMX-BF16 (Intel Sapphire Rapids+): there oneDNN runs bfloat16 GEMMs at about twice float32's rate and
the C kernels convert with one instruction. Elsewhere oneDNN emulates bfloat16 and it is slower than
float32. The flags come from torch's CPU probe (cpuinfo; the kernel's view, which also knows whether the
OS enabled AMX), else from /proc/cpuinfo; never from the machine's name.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

# Our name -> (torch's capability key, the /proc/cpuinfo flag).
_FLAGS = {
    "avx512_bf16": ("avx512_bf16", "avx512_bf16"),
    "amx_bf16": ("amx_bf16", "amx_bf16"),
}


@dataclass(frozen=True)
class CpuIsa:
    """The bfloat16-relevant instruction sets of the CPU this process runs on."""

    name: str
    avx512_bf16: bool
    amx_bf16: bool

    @property
    def native_bfloat16(self) -> bool:
        """True where bfloat16 GEMMs and conversions run in hardware (AVX512-BF16 or AMX-BF16)."""
        return self.avx512_bf16 or self.amx_bf16

    def describe(self) -> str:
        """One line for logs and benchmark reports, e.g. "AMD EPYC: bfloat16 native (avx512_bf16)"."""
        native = [flag for flag in _FLAGS if getattr(self, flag)]
        support = f"bfloat16 native ({', '.join(native)})" if native else "bfloat16 not native (emulated)"
        return f"{self.name}: {support}"


def _torch_capabilities() -> dict[str, object] | None:
    import torch  # here, not at the top: the benchmark's and server's reports import this module

    probe = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    if probe is None:
        return None
    try:
        capabilities = probe()
    except RuntimeError:
        return None
    return capabilities if isinstance(capabilities, dict) else None


def proc_cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("", empty) where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "", set()
    name, flags = "", set[str]()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not name:
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return name, flags


def detect() -> CpuIsa:
    """Probe the CPU (not cached: tests call it directly; use `cpu_isa()` in the engine)."""
    capabilities = _torch_capabilities()
    proc_name, proc_flags = proc_cpuinfo()
    if capabilities is not None:
        found = {ours: bool(capabilities.get(key, False)) for ours, (key, _) in _FLAGS.items()}
        name = proc_name or str(capabilities.get("cpu_name") or "")
    else:
        found = {ours: flag in proc_flags for ours, (_, flag) in _FLAGS.items()}
        name = proc_name
    return CpuIsa(name=name or platform.processor() or platform.machine(), **found)


@functools.cache
def cpu_isa() -> CpuIsa:
    """This machine's CPU, probed once per process."""
    return detect()
