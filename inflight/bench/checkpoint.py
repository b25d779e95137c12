"""The checkpoint every benchmarked system reads: `--model` resolved to a Hugging Face folder.

inflight reads GGUF files itself, but vLLM-CPU and the transformers baselines want a Hugging Face folder.
So a GGUF `--model` (a file, or builtin:smollm2) is exported once, dequantized to float32 by transformers'
own GGUF loader, to `<file's folder>/<stem>-hf/` (config.json, model.safetensors, tokenizer files), and
every system, inflight included, runs on that folder: the same weights and tokenizer for all of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from inflight.checkpoints.builtin import build_once
from inflight.checkpoints.resolve import resolve_model
from inflight.engine.gguf import is_gguf


def _say(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def export_gguf(gguf_file: Path, out: Path) -> None:
    """Write `gguf_file` as a Hugging Face checkpoint folder `out` (float32 safetensors + tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(f"exporting {gguf_file} to a Hugging Face folder {out} (once; dequantized to float32)")
    folder, name = str(gguf_file.parent), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers refuses save_pretrained on a GGUF-loaded model; its weights are plain float32 tensors.
    out.mkdir(parents=True)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    _add_classic_rope_theta(out / "config.json")
    tied = bool(model.config.tie_word_embeddings)
    weights = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")  # the embedding is the LM head
    }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


def _add_classic_rope_theta(config_json: Path) -> None:
    """transformers 5 writes only `rope_parameters`; older readers (vLLM's) want `rope_theta` too."""
    raw = json.loads(config_json.read_text())
    theta = (raw.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        raw.setdefault("rope_theta", theta)
        config_json.write_text(json.dumps(raw, indent=2) + "\n")


def inflight_checkpoint(model: str, exported: Path, quantization: str) -> Path:
    """What inflight's own systems read: the GGUF file itself when `model` is one and its weights are to
    stay quantized (`--quantization` other than none: kept in its blocks, or quantized at load), else the
    `exported` folder every system reads."""
    path = resolve_model(model)
    return path if is_gguf(path) and quantization != "none" else exported


def bench_checkpoint(model: str) -> Path:
    """The Hugging Face folder to benchmark for `--model` (folder, .gguf file or builtin:NAME)."""
    path = resolve_model(model)
    if not is_gguf(path):
        return path
    return build_once(path.parent / f"{path.stem}-hf", lambda out: export_gguf(path, out), _say)
