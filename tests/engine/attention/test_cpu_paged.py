"""The C paged-attention kernels for CPU (decode, prefill) against a dense float64 reference and torch."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from inflight.engine.attention import cpu_paged, torch_paged
from inflight.engine.attention.backend import get_attention_backend
from inflight.engine.cpu import kernels as cpu_kernels
from inflight.engine.cpu.isa import cpu_isa, proc_cpuinfo

from support.paged_cases import PagedCase, dense_reference, make_case

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.skipif(
    not cpu_paged.kernel_available(), reason=f"CPU kernels not built: {cpu_kernels.unavailable_reason()}"
)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    error = (actual.double() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max abs error {error} > {TOLERANCE[dtype]} for {dtype}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1), (9, 3), (10, 2)])
def test_decode_ragged_lengths_across_block_boundaries(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype, torch_threads: int
) -> None:
    # 1 token, one block exactly, one past a block, two blocks, a tile (8) inside a block, many blocks.
    seq_lens = [1, 16, 17, 32, 8, 9, 141]
    case = make_case(
        seq_lens, [1] * len(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype
    )
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), dtype)


@pytest.mark.parametrize("extra_rows", [-1, 0, 3])
def test_work_items_whole_rows_or_one_kv_head(torch_threads: int, extra_rows: int) -> None:
    # At least as many rows as threads: one work item per row (all KV heads); fewer (one row on two
    # threads): one per (row, KV head).
    rows = max(1, torch_threads + extra_rows)
    seq_lens = [(7 * i) % 90 + 1 + 50 * (i % 2) for i in range(rows)]
    case = make_case(seq_lens, [1] * len(seq_lens), num_heads=8, num_kv_heads=4, seed=7)
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_across_many_blocks(dtype: torch.dtype, torch_threads: int) -> None:
    # Over 8 MiB of K/V in one call, 100+ blocks per sequence: prefetching runs far ahead of the reads.
    seq_lens = [2100, 1900, 2048, 700, 1500]
    case = make_case(seq_lens, [1] * len(seq_lens), num_heads=8, num_kv_heads=4, head_dim=64, dtype=dtype)
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_equals_the_reference_and_the_torch_path(dtype: torch.dtype) -> None:
    # A decode, a chunk after a cached prefix ending mid-block, a whole prompt, a 1-token prompt, a decode.
    case = make_case([40, 37, 70, 1, 90], [1, 13, 70, 1, 1], num_heads=8, num_kv_heads=2, dtype=dtype, seed=1)
    args = (case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    out = cpu_paged.paged_attention(*args)
    assert_close(out, dense_reference(case), dtype)
    assert_close(out, torch_paged.paged_attention(*args).double(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 32), (10, 2, 48), (6, 3, 24)]
)
def test_prompts_across_row_tiles_and_blocks(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, torch_threads: int
) -> None:
    # The prefill kernel takes 32 rows of a prompt per work item: prompts of 2 rows, one short of a tile,
    # exactly one, one past, a chunk of 70 rows after a 20-token prefix, 300 rows; among two decodes.
    seq_lens = [2, 31, 32, 33, 90, 50, 300]
    query_lens = [2, 31, 32, 33, 70, 1, 300]
    case = make_case(
        seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prompts_and_a_chunk_after_a_long_prefix(dtype: torch.dtype) -> None:
    # Past the old SDPA cut-over (256 keys): a 600-token prompt, a 300-token chunk after 1,800 cached tokens.
    case = make_case(
        [600, 2100, 70], [600, 300, 1], num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, seed=6
    )
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_keys_in_blocks_with_larger_scores_late(dtype: torch.dtype, torch_threads: int) -> None:
    # The prefill kernel goes over keys 256 at a time with an online softmax: keys from position 500 on
    # score four times larger, so each row's largest score so far grows in a later block and everything
    # weighed before must be rescaled. A whole 700-token prompt (odd), a 261-row chunk after 739 tokens.
    case = make_case([700, 1000], [700, 261], num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, seed=8)
    block_size = case.k_cache.shape[1]
    for seq, seq_len in enumerate(case.meta.seq_lens_list):
        for pos in range(500, seq_len):
            block = int(case.meta.block_tables[seq, pos // block_size])
            case.k_cache[block, pos % block_size] *= 4
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_last_keys_large_score_leaves_the_rows_before_it_alone(dtype: torch.dtype) -> None:
    # The prefill kernel scores 8 query vectors at a time (here rows 397-399's, the last 8 of each prompt)
    # over the keys of their last row, and takes each vector's largest score from the score kernel only
    # where it scored exactly that vector's keys. The last key scores about +-300: a row before it that
    # took that score as its largest would weigh its own keys e^-300 = 0 and divide by zero. (The last
    # row itself, which attends that key, is left out: float32 scores of 300 are 3e-5 apart.)
    query_lens = [400, 700]
    case = make_case([400, 1000], query_lens, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, seed=9)
    block_size = case.k_cache.shape[1]
    for seq, seq_len in enumerate(case.meta.seq_lens_list):
        block = int(case.meta.block_tables[seq, (seq_len - 1) // block_size])
        case.k_cache[block, (seq_len - 1) % block_size] *= 300
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    before_last = torch.ones(sum(query_lens), dtype=torch.bool)
    before_last[torch.tensor(query_lens).cumsum(0) - 1] = False
    assert_close(out[before_last], dense_reference(case)[before_last], dtype)


def decode_on_threads(case: PagedCase, thread_counts: tuple[int, ...]) -> list[torch.Tensor]:
    """The C decode kernel's output for `case` with torch set to each of `thread_counts` threads."""
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            outs.append(
                cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
            )
    finally:
        torch.set_num_threads(before)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_decode_row_has_the_same_bits_on_one_and_two_threads(dtype: torch.dtype) -> None:
    # A batch-1 decode step: one row over a few hundred keys runs on every thread, one KV head an item,
    # and gives the bits it gives as one item on one thread.
    case = make_case([300], [1], num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, seed=5)
    outs = decode_on_threads(case, (1, 2))
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[0], dense_reference(case), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_split_into_parts_keep_their_bits_on_any_thread_count(dtype: torch.dtype) -> None:
    # Rows over 1024 keys are split into parts of 1024 (the last shorter) and merged, by the row's own
    # length: the 7 parts here run as whole-part items on one or two threads and as one KV head of a part
    # each on eight (fewer parts than threads), and all three give the same bits.
    seq_lens = [2100, 300, 1025, 40]
    case = make_case(
        seq_lens, [1] * len(seq_lens), num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, seed=3
    )
    outs = decode_on_threads(case, (1, 2, 8))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])
    assert_close(outs[0], dense_reference(case), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_window_longer_than_a_part(dtype: torch.dtype) -> None:
    # A 1500-key window: its rows' keys split into parts from the window's start, not from key 0.
    case = make_case(
        [3000, 1200, 700],
        [1, 1, 1],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
        sliding_window=1500,
    )
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_longer_than_a_block_of_keys(dtype: torch.dtype) -> None:
    # A 300-key window spans two of the prefill kernel's 256-key blocks, starting inside the first.
    case = make_case(
        [900, 700], [900, 101], num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, sliding_window=300
    )
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), dtype)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [9, 1, 30], [70, 1, 40]])
def test_sliding_window_masks_old_keys(query_lens: list[int]) -> None:
    case = make_case([90, 45, 40], query_lens, num_heads=4, num_kv_heads=2, sliding_window=20, seed=2)
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    expected = dense_reference(case)
    assert_close(out, expected, torch.float32)
    case.meta.sliding_window = None
    assert (dense_reference(case) - expected).abs().max() > 1e-2  # the window changed the answer


def test_odd_head_dim_and_block_size() -> None:
    case = make_case([23, 5, 11], [1, 1, 1], num_heads=6, num_kv_heads=3, head_dim=24, block_size=5, seed=3)
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), torch.float32)


def test_float16_and_transposed_queries_fall_back_to_the_torch_path() -> None:
    case = make_case([30, 12], [1, 1], num_heads=4, num_kv_heads=2, dtype=torch.float16, seed=4)
    args = (case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert torch.equal(cpu_paged.paged_attention(*args), torch_paged.paged_attention(*args))
    case = make_case([30, 12], [1, 1], num_heads=4, num_kv_heads=2, seed=4)
    transposed = case.query.transpose(1, 2).contiguous().transpose(1, 2)
    assert not cpu_paged._kernel_handles(transposed, case.k_cache, case.v_cache)
    out = cpu_paged.paged_attention(transposed, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_may_be_rows_of_the_fused_qkv_projection(dtype: torch.dtype) -> None:
    case = make_case([30, 12, 50], [1, 1, 1], num_heads=4, num_kv_heads=2, dtype=dtype, seed=5)
    fused = torch.randn(3, (4 + 2 * 2) * 32).to(dtype)
    fused[:, : 4 * 32] = case.query.reshape(3, -1)
    query = fused[:, : 4 * 32].view(3, 4, 32)
    assert not query.is_contiguous() and cpu_paged._kernel_handles(query, case.k_cache, case.v_cache)
    out = cpu_paged.paged_attention(query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_from_the_fused_projection_equals_the_torch_path(dtype: torch.dtype) -> None:
    # k and v as the model hands them over: row views into q|k|v, 3 KV heads, slots across blocks.
    num_heads, num_kv_heads, head_dim, tokens = 9, 3, 16, 5
    fused = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    key = fused[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    value = fused[:, q_size + kv_size :].view(tokens, num_kv_heads, head_dim)
    slots = torch.tensor([3, 15, 16, 40, 0])
    caches = [torch.randn(4, 16, num_kv_heads, head_dim).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    torch_paged.write_kv_cache(key, value, *expected, slots)
    cpu_paged.write_kv_cache(key, value, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_kv_write_the_kernel_cannot_take_falls_back_to_the_torch_path() -> None:
    # Heads not contiguous within a row, and a float16 cache: the torch path stores them.
    key = torch.randn(2, 8, 2).transpose(1, 2)
    caches = [torch.zeros(2, 4, 2, 8) for _ in range(2)]
    cpu_paged.write_kv_cache(key, -key, *caches, torch.tensor([1, 6]))
    assert torch.equal(caches[0].view(-1, 2, 8)[[1, 6]], key)
    assert torch.equal(caches[1].view(-1, 2, 8)[[1, 6]], -key)
    half = [torch.zeros(2, 4, 2, 8, dtype=torch.float16) for _ in range(2)]
    cpu_paged.write_kv_cache(key.half(), key.half(), *half, torch.tensor([7, 0]))
    assert torch.equal(half[0].view(-1, 2, 8)[[7, 0]], key.half())


def test_cpu_backend_is_the_kernel() -> None:
    backend = get_attention_backend(torch.device("cpu"))
    assert backend.name == "cpu-kernel"
    assert backend.paged_attention is cpu_paged.paged_attention
    assert backend.write_kv_cache is cpu_paged.write_kv_cache


def test_build_is_cached_per_source_and_names_a_missing_compiler(tmp_path: Path) -> None:
    first = cpu_kernels.build_library(out_dir=tmp_path)
    built_at = first.stat().st_mtime_ns
    assert cpu_kernels.build_library(out_dir=tmp_path) == first
    assert first.stat().st_mtime_ns == built_at  # not rebuilt
    with pytest.raises(cpu_kernels.KernelBuildError, match="no C compiler: 'no-such-cc'"):
        cpu_kernels.build_library(compiler="no-such-cc", out_dir=tmp_path)


def test_another_kernels_c_builds_its_own_library_with_the_engines_other_sources(tmp_path: Path) -> None:
    """A kernels.c outside the package (the attention benchmarks' --compare) still finds kernels.h and
    builds into a library of its own, not the cached one of the package's kernels.c."""
    other = tmp_path / "elsewhere" / "kernels.c"
    other.parent.mkdir()
    other.write_text(cpu_kernels.SOURCE.read_text() + "\n/* an older version */\n")
    ours = cpu_kernels.build_library(out_dir=tmp_path / "out")
    theirs = cpu_kernels.build_library(out_dir=tmp_path / "out", kernels_source=other)
    assert theirs != ours
    assert cpu_kernels.load_library(theirs).quant_linear_int8_activations() in (0, 1)


def test_a_folder_of_other_c_files_builds_from_every_file_in_it(tmp_path: Path) -> None:
    """`source_dir` (kernels_ab.py's older commit): each compiled file comes from that folder, not only
    kernels.c (a quant_kernels.c that cannot compile there fails the build, naming itself)."""
    folder = tmp_path / "older"
    folder.mkdir()
    for path in cpu_kernels.SOURCE.parent.glob("*.[ch]"):
        shutil.copy(path, folder / path.name)
    ours = cpu_kernels.build_library(out_dir=tmp_path / "out")
    assert cpu_kernels.build_library(out_dir=tmp_path / "out", source_dir=folder) == ours  # the same bytes
    (folder / cpu_kernels.QUANT_SOURCE.name).write_text('#error "the folder\'s quant_kernels.c"\n')
    with pytest.raises(cpu_kernels.KernelBuildError, match=r"the folder's quant_kernels\.c"):
        cpu_kernels.build_library(out_dir=tmp_path / "out", source_dir=folder)


def test_compile_errors_are_reported_with_the_compiler_output(tmp_path: Path) -> None:
    fake = tmp_path / "cc"
    fake.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'error: broken toolchain' >&2\nexit 3\n"
    )
    fake.chmod(0o755)
    with pytest.raises(cpu_kernels.KernelBuildError, match=r"exit 3\):\nerror: broken toolchain"):
        cpu_kernels.build_library(compiler=str(fake), out_dir=tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))


def test_disabled_by_environment_or_missing_compiler_uses_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    library = cpu_kernels._Library()
    assert library.get() is None
    assert library.unavailable_reason == "INFLIGHT_CPU_KERNELS=0"

    monkeypatch.delenv(cpu_kernels.DISABLE_ENV)
    monkeypatch.setenv("CC", "no-such-cc")
    library = cpu_kernels._Library()
    with caplog.at_level("WARNING", logger="inflight.engine"):
        assert library.get() is None
    assert "using the PyTorch code instead: no C compiler" in caplog.text


PORTABLE_FLAGS = tuple(flag for flag in cpu_kernels.COMPILE_FLAGS if flag != "-march=native")
AVX512_FLAGS = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4
# Each build's extra compiler flags and the CPU flags it needs to run.
BUILDS: dict[str, tuple[tuple[str, ...], set[str]]] = {
    "portable": ((), set()),
    "avx2": (("-march=x86-64-v3",), {"avx2", "fma"}),
    "avx512-without-bf16": (("-march=x86-64-v4",), AVX512_FLAGS),
}


# Compiler targets for every instruction set the C files have code for: the portable C, AVX2 + FMA, AVX-512,
# AVX-512 with AVX512-BF16, VNNI and the AMX tiles.
WARNING_TARGETS = ("", "-march=x86-64-v3", "-march=x86-64-v4", "-march=sapphirerapids")


def _is_gcc(compiler: str) -> bool:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    return "Free Software Foundation" in version


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the -march targets are x86-64's")
@pytest.mark.parametrize("target", WARNING_TARGETS)
def test_every_builds_c_compiles_without_warnings(target: str, tmp_path: Path) -> None:
    """-Wall -Wextra on each build's code (built by the engine's own build command for the target, never
    loaded, so any x86-64 machine checks them all): a variable or function that only another build's code
    reads is dead code in this one."""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None or not _is_gcc(compiler):
        pytest.skip("the warning flags are checked with GCC")
    flags = (*PORTABLE_FLAGS, *([target] if target else []), "-O0", "-Wall", "-Wextra", "-Werror")
    cpu_kernels.build_library(out_dir=tmp_path, flags=flags)  # KernelBuildError with the compiler's messages


def _build(name: str, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """BUILDS[name], built once per test session (skips where this CPU cannot run it)."""
    extra_flags, cpu_flags = BUILDS[name]
    if not cpu_flags.issubset(proc_cpuinfo()[1]):
        pytest.skip(f"this CPU cannot run {name} code")
    flags = (*PORTABLE_FLAGS, *extra_flags)
    out_dir = tmp_path_factory.getbasetemp() / f"kernels-{name}"
    return cpu_kernels.load_library(cpu_kernels.build_library(out_dir=out_dir, flags=flags))


@pytest.fixture(scope="module", params=list(BUILDS))
def portable_library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The kernels built without -march=native: the plain C path of CPUs without AVX2 + FMA (e.g. Arm),
    the AVX2 path of CPUs without AVX-512 (Zen 1-3, most desktops), and AVX-512 without AVX512-BF16
    (Skylake-X / Ice Lake: bfloat16 rounded in integer arithmetic), where this CPU can run them."""
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["native", *BUILDS])
def any_library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The kernels as built for this machine, then each portable build."""
    if request.param != "native":
        return _build(request.param, tmp_path_factory)
    library = cpu_kernels.library()
    assert library is not None
    return library


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_portable_c_path_matches_the_references(
    portable_library: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, torch_threads: int
) -> None:
    from inflight.engine.model import ops

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(40, 96, generator=gen).to(dtype)
    residual = torch.randn(40, 96, generator=gen).to(dtype)
    weight = torch.rand(96, generator=gen).to(dtype)
    gate_up = (torch.randn(40, 2 * 80, generator=gen) * 4).to(dtype)
    qkv = torch.randn(40, (4 + 2 * 2) * 16, generator=gen).to(dtype)
    angles = torch.rand(40, 1, 8, generator=gen) * 6
    rope_args = (4, 2, 16, angles.cos(), angles.sin())
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    expected_norm, expected_sum = ops.rms_norm(x, weight, 1e-5, residual.clone())
    expected_silu = ops.silu_and_mul(gate_up)
    expected_qkv = ops.split_qkv_with_rotary(qkv.clone(), *rope_args)

    monkeypatch.setattr(cpu_kernels, "library", lambda: portable_library)
    tolerance = 2 * TOLERANCE[dtype]
    for seq_lens, query_lens, window in (
        ([1, 16, 17, 32, 8, 9, 141], [1] * 7, None),
        ([1, 16, 17, 32, 8, 9, 141], [1, 16, 5, 32, 1, 9, 70], None),
        ([90, 45, 40, 3], [1] * 4, 20),
        ([90, 45, 40, 3], [40, 1, 40, 3], 20),
        ([600, 700, 5], [600, 37, 1], None),  # several blocks of keys
    ):
        shapes = ((8, 2, 32), (8, 1, 24), (6, 6, 40), (9, 3, 64), (10, 2, 48))
        for num_heads, num_kv_heads, head_dim in shapes:
            case = make_case(
                seq_lens,
                query_lens,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                sliding_window=window,
            )
            out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
            assert (out.double() - dense_reference(case)).abs().max() <= tolerance
    normed, summed = ops.rms_norm(x, weight, 1e-5, residual)
    for actual, wanted in [
        (normed, expected_norm),
        (summed, expected_sum),
        (ops.silu_and_mul(gate_up), expected_silu),
        *zip(ops.split_qkv_with_rotary(qkv, *rope_args), expected_qkv, strict=True),
    ]:
        torch.testing.assert_close(actual.float(), wanted.float(), atol=tolerance, rtol=tolerance)


def test_bfloat16_rounds_like_torch(any_library: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotary with sin = 0 is one float product rounded to bfloat16 once: bit for bit what torch gives,
    so this checks the kernels' float -> bfloat16 rounding exactly, ties to even included (a factor of
    1 + 2^-8 puts many products exactly halfway between two bfloat16 values)."""
    from inflight.engine.model import ops

    gen = torch.Generator().manual_seed(3)
    rows, num_heads, head_dim = 64, 3, 64  # and one KV head: q and k are the first 4 heads of a row
    qkv = (torch.randn(rows, (num_heads + 2) * head_dim, generator=gen) * 10).to(torch.bfloat16)
    cos = torch.randn(rows, 1, head_dim // 2, generator=gen)
    cos[::2] = 1 + 2**-8
    sin = torch.zeros_like(cos)
    halves = qkv[:, : (num_heads + 1) * head_dim].float().view(rows, num_heads + 1, 2, head_dim // 2)
    expected = (halves * cos.unsqueeze(2)).to(torch.bfloat16).view(rows, -1)
    monkeypatch.setattr(cpu_kernels, "library", lambda: any_library)
    q, k, _ = ops.split_qkv_with_rotary(qkv, num_heads, 1, head_dim, cos, sin)
    assert q.data_ptr() == qkv.data_ptr()  # the kernel ran (it rotates in place)
    assert torch.equal(torch.cat([q.reshape(rows, -1), k.reshape(rows, -1)], dim=1), expected)


def test_argmax_rows_answers_like_torch(
    any_library: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, torch_threads: int
) -> None:
    """The greedy choice: the first of equal largest values, the first NaN of a row that has one, index 0
    of a row of -inf; rows of every length around the 16-lane width."""
    from inflight.engine.sampler import argmax_rows

    monkeypatch.setattr(cpu_kernels, "library", lambda: any_library)
    for cols in (1, 2, 15, 16, 17, 33, 100, 4099):
        gen = torch.Generator().manual_seed(cols)
        x = torch.randn(8, cols, generator=gen)
        x[1] = float("-inf")
        x[2] = 0.0
        x[3, cols // 2 :] = float("nan")
        x[4, -1] = 1e30
        x[5, cols // 3] = x[5, -1] = 1e30
        x[6, -1] = float("nan")
        x[7, cols // 2] = float("inf")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), cols


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
def test_bfloat16_prompts_multiply_on_the_amx_tiles_where_the_cpu_has_them(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    # Where the CPU has AMX-BF16 (and the library was built for it), bfloat16 prompt items are tile
    # products: 64-row items, the last one partial (vectors padded to 16), key blocks of 256 with the last
    # one partial (values padded to 32), a chunk of few rows after a long prefix, and decodes beside them.
    library = cpu_kernels.library()
    assert library is not None
    assert library.prefill_tiles() == (1 if cpu_isa().amx_bf16 else 0)
    seq_lens = [40, 701, 1000, 300, 70]
    query_lens = [1, 701, 37, 300, 1]
    case = make_case(
        seq_lens,
        query_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
    )
    out = cpu_paged.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, dense_reference(case), torch.bfloat16)
