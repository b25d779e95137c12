"""`inflight make-model`: a real Hugging Face checkpoint with random weights and a locally trained tokenizer.

Everything is derived from the preset, the architecture, the seed and the Python standard library's
sources (the tokenizer's training text, present on every machine), so the same inputs give the same
bytes. The checkpoint loads with `transformers.AutoModelForCausalLM` / `AutoTokenizer` and with ours.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)

# Splits text into words, single digits, punctuation runs and whitespace before byte-level BPE.
PRETOKENIZE_PATTERN = "|".join(
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",  # English contractions
        r"[^\r\n\p{L}\p{N}]?\p{L}+",  # a word, with one leading non-letter (usually a space)
        r"\p{N}",  # one digit
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",  # punctuation runs
        r"\s*[\r\n]+",  # line breaks
        r"\s+(?!\S)",  # whitespace not followed by a word
        r"\s+",
    )
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    # Mistral's attention window; small enough in `tiny` that tests cross it.
    sliding_window: int
    # How much standard-library source the tokenizer trains on.
    corpus_bytes: int
    # The model's vocabulary when it is larger than the tokenizer's (rows the tokenizer never produces,
    # as Llama 3's 128256); None = the tokenizer's.
    model_vocab_size: int | None = None
    # Whether lm_head is the embedding matrix; None = as the architecture's checkpoints do (qwen2 only).
    tied_embeddings: bool | None = None
    # The dtype the weights are stored in.
    weights_dtype: str = "float32"

    def ties(self, arch: str) -> bool:
        return self.tied_embeddings if self.tied_embeddings is not None else arch == "qwen2"


PRESETS = {
    "tiny": Preset(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        vocab_size=2048,
        max_position_embeddings=2048,
        sliding_window=32,
        corpus_bytes=1_500_000,
    ),
    "small": Preset(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        vocab_size=8192,
        max_position_embeddings=2048,
        sliding_window=1024,
        corpus_bytes=4_000_000,
    ),
    # Llama-3.2-1B's shape (1.24 B parameters, stored in bfloat16 as Meta ships it).
    "llama-1b": Preset(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=8192,
        max_position_embeddings=8192,
        sliding_window=4096,
        corpus_bytes=4_000_000,
        model_vocab_size=128256,
        tied_embeddings=True,
        weights_dtype="bfloat16",
    ),
}

Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def corpus_files(corpus_bytes: int) -> list[Path]:
    """The tokenizer's training text: the standard library's top-level modules, sorted, up to a size."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        if total >= corpus_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    if not files:
        raise RuntimeError(f"no Python sources under {stdlib} to train the tokenizer on")
    return files


def fingerprint(preset: str) -> str:
    """A short hash of everything the checkpoint's bytes depend on, besides arch and seed (for caches)."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    import tokenizers

    digest.update(f"{torch.__version__} {tokenizers.__version__}".encode())
    for path in corpus_files(PRESETS[preset].corpus_bytes):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:12]


def make_model(
    out_dir: Path,
    preset: str = "tiny",
    arch: str = "llama",
    seed: int = 0,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a checkpoint folder to `out_dir` and return it. Its messages name no path: a caller may
    write into a temporary folder and move it (the built-in models do), so the caller names the result.

    `out_dir` must not exist or be empty unless `overwrite`. The folder appears complete or not at all:
    it is written next to `out_dir` and renamed into place.
    """
    say = progress or _stderr
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True (--force) to replace it")
    spec = PRESETS[preset]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        say(f"make-model: {preset} {arch} (seed {seed})")
        tokenizer = _train_tokenizer(spec, add_bos=arch != "qwen2", say=say)
        tokenizer.save(str(tmp / "tokenizer.json"))
        ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
        config = _hf_config(spec, arch, tokenizer.get_vocab_size(), ids)
        _write_json(tmp / "config.json", config)
        _write_tokenizer_files(tmp, arch, ids, spec)
        num_params = _count_params(spec, arch, config["vocab_size"])
        say(f"make-model: writing random weights ({num_params:,} parameters)")
        _write_weights(tmp / "model.safetensors", spec, arch, config["vocab_size"], seed)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _train_tokenizer(spec: Preset, add_bos: bool, say: Progress) -> Any:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    files = corpus_files(spec.corpus_bytes)
    size = sum(p.stat().st_size for p in files)
    say(
        f"make-model: training a byte-level BPE tokenizer (vocab {spec.vocab_size}) on "
        f"{len(files)} standard-library files ({size / 1e6:.1f} MB)"
    )
    tokenizer = Tokenizer(models.BPE())
    # The pre-tokenization of Qwen2 / Llama 3 style tokenizers (transformers' Qwen2Tokenizer imposes
    # exactly this one, so the files must carry it too to encode the same everywhere).
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        for path in files:
            yield path.read_text(encoding="utf-8", errors="replace")

    tokenizer.train_from_iterator(texts(), trainer=trainer, length=len(files))
    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        bos = tokenizer.token_to_id(BOS)
        template = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos)]
        )
        tokenizer.post_processor = processors.Sequence([byte_level, template])
    else:
        tokenizer.post_processor = byte_level
    say(f"make-model: tokenizer trained: {tokenizer.get_vocab_size()} tokens")
    return tokenizer


def _hf_config(spec: Preset, arch: str, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    head_dim = spec.hidden_size // spec.num_attention_heads
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": max(vocab_size, spec.model_vocab_size or 0),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5 if arch == "llama" else 1e-6,
        "use_cache": True,
        "bos_token_id": None if arch == "qwen2" else ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "tie_word_embeddings": spec.ties(arch),
        "attention_dropout": 0.0,
        "torch_dtype": spec.weights_dtype,
    }
    if arch == "llama":
        config["rope_theta"] = 500000.0
        # Llama 3.1's long-context scaling, with an original context short enough that all three
        # frequency bands (kept, interpolated, divided) occur for this head size.
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": spec.max_position_embeddings // 8,
        }
        config["attention_bias"] = False
        config["mlp_bias"] = False
    elif arch == "qwen2":
        config["rope_theta"] = 1000000.0
        config["use_sliding_window"] = False
        config["sliding_window"] = None
        config["max_window_layers"] = spec.num_hidden_layers
    else:
        config["rope_theta"] = 10000.0
        config["sliding_window"] = spec.sliding_window
    return config


def _write_tokenizer_files(out: Path, arch: str, ids: dict[str, int], spec: Preset) -> None:
    bos = None if arch == "qwen2" else BOS
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    special_tokens_map = {"eos_token": EOS, "pad_token": PAD, **({"bos_token": bos} if bos else {})}
    _write_json(out / "special_tokens_map.json", special_tokens_map)
    generation_config = {
        "bos_token_id": None if bos is None else ids[BOS],
        "eos_token_id": [ids[EOS], ids[IM_END]],
        "pad_token_id": ids[PAD],
    }
    _write_json(out / "generation_config.json", generation_config)


def _tensor_shapes(spec: Preset, arch: str, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in a fixed order (the order random values are drawn in)."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    head_dim = hidden // spec.num_attention_heads
    q, kv = spec.num_attention_heads * head_dim, spec.num_key_value_heads * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab_size, hidden))]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (q, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv, hidden)),
        ]
        if arch == "qwen2":
            shapes += [
                (f"{p}.self_attn.q_proj.bias", (q,)),
                (f"{p}.self_attn.k_proj.bias", (kv,)),
                (f"{p}.self_attn.v_proj.bias", (kv,)),
            ]
        shapes += [
            (f"{p}.self_attn.o_proj.weight", (hidden, q)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{p}.mlp.up_proj.weight", (inter, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not spec.ties(arch):
        shapes.append(("lm_head.weight", (vocab_size, hidden)))
    return shapes


def _count_params(spec: Preset, arch: str, vocab_size: int) -> int:
    total = 0
    for _, shape in _tensor_shapes(spec, arch, vocab_size):
        count = 1
        for dim in shape:
            count *= dim
        total += count
    return total


def _write_weights(path: Path, spec: Preset, arch: str, vocab_size: int, seed: int) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.weights_dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _tensor_shapes(spec, arch, vocab_size):
        if name.endswith("norm.weight"):
            # Near one, but not exactly, so a norm weight applied wrongly shows in the outputs.
            tensors[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif name.endswith(".bias"):
            tensors[name] = 0.1 * torch.randn(shape, generator=generator)
        else:
            tensors[name] = 0.02 * torch.randn(shape, generator=generator)
        tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # like the other files (safetensors writes 0600)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
