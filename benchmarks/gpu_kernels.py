"""GPU benchmark: Triton paged-attention decode bandwidth and end-to-end engine tokens/s (one prepared run).

    .venv/bin/python benchmarks/gpu_kernels.py --out bench-results/gpu    # about 3-5 minutes on an H200

1. Checks the Triton kernels against the torch reference on the GPU (decode with split-K, mixed prefill).
2. Decode kernel sweep, Llama-3.2-1B attention shape (32 query heads, 8 KV heads, head_dim 64, bf16,
   block size 16, shuffled block tables): batch 1..256 x context 512..32k. Achieved HBM bandwidth =
   bytes moved (K and V of every context token, Q in, O out, block-table entries) / kernel time measured
   with CUDA events, and its fraction of the H200's ~4.8 TB/s.
3. Prefill kernel: TFLOP/s for a few prompt shapes.
4. End to end: `inflight.LLM` on a random Llama-3.2-1B-shaped checkpoint (bf16, written to a temp dir),
   generated tokens/s for a fixed workload with the continuous and the static scheduler.

Writes gpu_kernels.json (all figures) and prints a summary. Exits at once, with a message, without CUDA.
Each part records its error in the JSON and the run goes on, so one run says as much as it can.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

H200_PEAK_BYTES_PER_S = 4.8e12
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 64
BLOCK_SIZE = 16
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (512, 2048, 4096, 8192, 32768)
# Skip sweep points whose KV cache would not fit comfortably next to everything else.
MAX_CACHE_BYTES = 48 * 2**30

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "gpu_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False here). "
            "Run it on a GPU machine with a CUDA build of torch and triton installed; "
            "on CPU the kernels are checked by `pytest tests/engine/attention` under TRITON_INTERPRET=1."
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("gpu_kernels.py needs the `triton` package: pip install triton") from None


def cuda_time_ms(fn: Callable[[], object], min_total_ms: float = 100.0) -> float:
    """Median time of `fn` in milliseconds, by CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    iterations = max(5, min(200, math.ceil(min_total_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(iterations):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def make_batch(
    seq_lens: list[int], query_lens: list[int], dtype: torch.dtype, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """Query, a shuffled paged K/V cache holding every context, and the metadata, on the GPU."""
    from inflight.engine.attention.metadata import AttentionMetadata

    device = torch.device("cuda")
    blocks_per_seq = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots: list[int] = []
    first = 0
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        table = order[first : first + blocks_per_seq[i]]
        first += blocks_per_seq[i]
        block_tables[i, : len(table)] = table
        positions = torch.arange(seq_len - query_len, seq_len)
        slots += (table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE).tolist()
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return query, k_cache, v_cache, meta


def check_correctness() -> dict[str, Any]:
    """Triton vs the torch reference on the GPU, bf16, for decode (with and without split-K) and mixed."""
    from inflight.engine.attention import torch_paged, triton_paged
    from inflight.engine.attention.kv_store import FP8_DTYPE, to_cache

    generator = torch.Generator().manual_seed(0)
    cases = {
        "decode": ([4096, 17, 1000, 1], [1, 1, 1, 1], None),
        "decode_split_k": ([8192, 300], [1, 1], 8),
        "mixed_prefill": ([700, 33, 2048, 5], [700, 1, 100, 5], None),
    }
    errors: dict[str, Any] = {}
    for name, (seq_lens, query_lens, splits) in cases.items():
        query, k_cache, v_cache, meta = make_batch(seq_lens, query_lens, torch.bfloat16, generator)
        scale = HEAD_DIM**-0.5
        expected = torch_paged.paged_attention(query.float(), k_cache.float(), v_cache.float(), meta, scale)
        actual = triton_paged.paged_attention(query, k_cache, v_cache, meta, scale, num_splits=splits)
        error = (actual.float() - expected).abs().max().item()
        errors[name] = {"max_abs_error": error, "ok": error < 3e-2}
        say(f"check {name}: max abs error vs torch reference {error:.2e}")
        k_fp8, v_fp8 = to_cache(k_cache.float() * 8, FP8_DTYPE), to_cache(v_cache.float() * 8, FP8_DTYPE)
        expected = torch_paged.paged_attention(query.float(), k_fp8.float(), v_fp8.float(), meta, scale)
        actual = triton_paged.paged_attention(query, k_fp8, v_fp8, meta, scale, num_splits=splits)
        error = ((actual.float() - expected).abs().max() / expected.abs().max()).item()
        errors[name + "_fp8_kv"] = {"max_rel_error": error, "ok": error < 3e-2}
        say(f"check {name} with a float8 KV cache: max error / max |reference| {error:.2e}")
    return errors


def decode_sweep(
    contexts: tuple[int, ...] = CONTEXTS, batches: tuple[int, ...] = BATCHES, fp8_kv: bool = False
) -> list[dict[str, Any]]:
    """Decode kernel bandwidth per (batch, context); `fp8_kv`: the caches are float8 (half the bytes)."""
    from inflight.engine.attention import triton_paged
    from inflight.engine.attention.kv_store import FP8_DTYPE, to_cache

    generator = torch.Generator().manual_seed(1)
    element = 1 if fp8_kv else torch.tensor([], dtype=torch.bfloat16).element_size()
    rows = []
    for context in contexts:
        for batch in batches:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * element
            if kv_bytes > MAX_CACHE_BYTES:
                rows.append({"batch": batch, "context": context, "skipped": "KV cache over the sweep's cap"})
                continue
            query, k_cache, v_cache, meta = make_batch(
                [context] * batch, [1] * batch, torch.bfloat16, generator
            )
            if fp8_kv:
                k_cache, v_cache = to_cache(k_cache.float(), FP8_DTYPE), to_cache(v_cache.float(), FP8_DTYPE)
            splits = triton_paged.choose_num_splits(batch * NUM_KV_HEADS, context, query.device)
            ms = cuda_time_ms(
                lambda q=query, k=k_cache, v=v_cache, m=meta: triton_paged.paged_attention(
                    q, k, v, m, HEAD_DIM**-0.5
                )
            )
            moved = kv_bytes + 2 * query.numel() * query.element_size() + meta.block_tables.numel() * 4
            bandwidth = moved / (ms / 1e3)
            row = {
                "batch": batch,
                "context": context,
                "kv_cache": "fp8" if fp8_kv else "bfloat16",
                "num_splits": splits,
                "kernel_ms": ms,
                "bytes_moved": moved,
                "bandwidth_tb_s": bandwidth / 1e12,
                "fraction_of_h200_peak": bandwidth / H200_PEAK_BYTES_PER_S,
            }
            rows.append(row)
            say(
                f"decode{' fp8 KV' if fp8_kv else ''} batch {batch:>3} context {context:>5}: {ms:8.3f} ms, "
                f"{bandwidth / 1e12:5.2f} TB/s "
                f"({bandwidth / H200_PEAK_BYTES_PER_S:.0%} of peak), splits {splits}"
            )
            del query, k_cache, v_cache, meta
            torch.cuda.empty_cache()
    return rows


def prefill_sweep() -> list[dict[str, Any]]:
    from inflight.engine.attention import triton_paged

    generator = torch.Generator().manual_seed(2)
    rows = []
    for batch, prompt in ((1, 8192), (4, 2048), (16, 512)):
        query, k_cache, v_cache, meta = make_batch(
            [prompt] * batch, [prompt] * batch, torch.bfloat16, generator
        )
        ms = cuda_time_ms(
            lambda q=query, k=k_cache, v=v_cache, m=meta: triton_paged.paged_attention(q, k, v, m, 0.125)
        )
        # Causal: about half of the QK^T and PV products.
        flops = 2 * 2 * batch * NUM_HEADS * HEAD_DIM * prompt * prompt / 2
        tflop_s = flops / (ms / 1e3) / 1e12
        rows.append({"batch": batch, "prompt": prompt, "kernel_ms": ms, "tflop_s": tflop_s})
        say(f"prefill batch {batch:>2} prompt {prompt:>5}: {ms:8.3f} ms, {tflop_s:6.1f} TFLOP/s")
    return rows


def write_random_llama_1b(folder: Path) -> None:
    """A Llama-3.2-1B-shaped checkpoint with random bf16 weights and a word-level tokenizer of its vocab."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    c = LLAMA_3_2_1B
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            weight = torch.randn(shape, generator=generator, device="cuda") * 0.02
            tensors[name] = weight.to(torch.bfloat16).cpu()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(c, indent=2))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 128000, "eos_token_id": 128001})
    )
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "t128000", "eos_token": "t128001"})
    )


def end_to_end(num_requests: int, prompt_len: int, output_len: int, max_slots: int) -> list[dict[str, Any]]:
    from inflight import LLM, SamplingParams

    rows = []
    with tempfile.TemporaryDirectory(prefix="inflight-llama1b-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        write_random_llama_1b(folder)
        say(f"e2e: wrote a random Llama-3.2-1B-shaped checkpoint in {time.perf_counter() - start:.1f} s")
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(10, 128000, (num_requests, prompt_len), generator=generator).tolist()
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        for scheduler in ("continuous", "static"):
            llm = LLM(str(folder), max_slots=max_slots, scheduler=scheduler, dtype="bfloat16")
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            torch.cuda.synchronize()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            generated = sum(len(o.outputs[0].token_ids) for o in outputs)
            rows.append(
                {
                    "scheduler": scheduler,
                    "num_requests": num_requests,
                    "prompt_len": prompt_len,
                    "output_len": output_len,
                    "max_slots": max_slots,
                    "generated_tokens": generated,
                    "exact_lengths": generated == num_requests * output_len,
                    "seconds": seconds,
                    "tokens_per_s": generated / seconds,
                }
            )
            say(
                f"e2e {scheduler}: {generated} tokens in {seconds:.1f} s = {generated / seconds:.0f} tokens/s"
            )
            del llm
            torch.cuda.empty_cache()
    return rows


def section(results: dict[str, Any], name: str, fn: Callable[[], Any], path: Path) -> None:
    """Runs one part, records its figures or its error, and rewrites `path` (a run cut short keeps the parts
    done so far)."""
    say(f"== {name}")
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as error:
        traceback.print_exc()
        results[name] = {"error": f"{type(error).__name__}: {error}"}
    say(f"== {name} took {time.perf_counter() - start:.1f} s")
    path.write_text(json.dumps(results, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/gpu"), help="output folder")
    parser.add_argument("--skip-e2e", action="store_true", help="kernels only")
    parser.add_argument("--e2e-requests", type=int, default=256)
    parser.add_argument("--e2e-prompt-len", type=int, default=512)
    parser.add_argument("--e2e-output-len", type=int, default=256)
    parser.add_argument("--e2e-max-slots", type=int, default=256)
    args = parser.parse_args()
    require_cuda()
    torch.backends.cuda.matmul.allow_tf32 = True
    props = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {
        "device": props.name,
        "memory_gib": props.total_memory / 2**30,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "peak_bandwidth_assumed_tb_s": H200_PEAK_BYTES_PER_S / 1e12,
        "attention_shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "block_size": BLOCK_SIZE,
    }
    say(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_kernels.json"
    section(results, "correctness", check_correctness, path)
    section(results, "decode", decode_sweep, path)
    section(results, "decode_fp8_kv", lambda: decode_sweep((4096, 32768), (16, 64, 256), fp8_kv=True), path)
    section(results, "prefill", prefill_sweep, path)
    if not args.skip_e2e:
        section(
            results,
            "end_to_end",
            lambda: end_to_end(
                args.e2e_requests, args.e2e_prompt_len, args.e2e_output_len, args.e2e_max_slots
            ),
            path,
        )
    headline = next(
        (
            r
            for r in results.get("decode", [])
            if isinstance(r, dict) and (r.get("batch"), r.get("context")) == (64, 4096)
        ),
        None,
    )
    if headline and "fraction_of_h200_peak" in headline:
        results["headline"] = {
            "decode_batch64_context4k_fraction_of_peak": headline["fraction_of_h200_peak"],
            "goal": 0.6,
        }
        say(f"headline: decode batch 64, context 4k: {headline['fraction_of_h200_peak']:.0%} of H200 peak")
    path.write_text(json.dumps(results, indent=2) + "\n")
    say(f"wrote {path}")
    failed = [name for name, value in results.items() if isinstance(value, dict) and "error" in value]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
