"""transformers as the reference: its greedy continuation of each prompt, never stopping early."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            # eos_token_id=None: never stop early, like ignore_eos on our side.
            config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=n)
            out = model.generate(torch.tensor([prompt]), generation_config=config)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs
