"""Checkpoints: what `--model` names (a folder, a .gguf file, `builtin:NAME`) and the random-weight maker.

- resolve.py: `--model` to a local path (the one rule every command and the benchmarks use).
- builtin.py: `builtin:smollm2` / `tiny` / `small`, made once into the cache dir under a file lock.
- make.py: `inflight make-model`: a random-weight Hugging Face checkpoint with a trained tokenizer.
"""
