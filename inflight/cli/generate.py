"""`inflight generate`: run prompts through the offline engine and print the completions."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from inflight.checkpoints.resolve import resolve_draft_model, resolve_model
from inflight.cli.args import add_model_arg
from inflight.engine.cli_args import add_engine_args, engine_config_from_args

if TYPE_CHECKING:
    from inflight.engine.output_processor import RequestOutput


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate",
        help="complete prompts with a local checkpoint (continuous batching, offline)",
        description="Complete each PROMPT with the checkpoint in --model and print the completions. "
        "All prompts run together through the engine's scheduler. A PROMPT of '-' reads standard input.",
    )
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text ('-' = read stdin)")
    add_model_arg(parser)
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--max-tokens", type=int, default=64, help="new tokens per completion (default: 64)"
    )
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    sampling.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    sampling.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the best")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats")
    sampling.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    sampling.add_argument("-n", type=int, default=1, help="completions per prompt (default: 1)")
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    sampling.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    add_engine_args(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from inflight.engine.engine import LLMEngine
    from inflight.engine.model.errors import ModelLoadError
    from inflight.engine.sequence import SamplingParams
    from inflight.engine.tokenizer import TokenizerError

    prompts = [sys.stdin.read() if p == "-" else p for p in args.prompts]
    try:
        model_dir = resolve_model(args.model)
        config = resolve_draft_model(engine_config_from_args(args))
    except SystemExit as e:
        print(f"inflight generate: {e}", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        print(
            f"inflight generate: loading {model_dir} (weights, tokenizer, kernels)...",
            file=sys.stderr,
            flush=True,
        )
        loading = time.monotonic()
        engine = LLMEngine(model_dir, config)
        print(
            f"inflight generate: loaded in {time.monotonic() - loading:.1f}s; generating "
            f"{len(prompts) * args.n} completion(s) of up to {args.max_tokens} tokens...",
            file=sys.stderr,
            flush=True,
        )
        if args.chat:
            prompts = [
                engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts
            ]
    except (ValueError, ValidationError, ModelLoadError, TokenizerError) as e:
        print(f"inflight generate: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()
    outputs = engine.generate(prompts, params)
    elapsed = time.monotonic() - start
    failed = 0
    for i, output in enumerate(outputs):
        failed += output.error is not None
        if args.json:
            print(json.dumps(_as_json(output)))
            continue
        print(f"--- prompt {i}: {output.prompt!r}")
        if output.error:
            print(f"error: {output.error}")
        for completion in output.outputs:
            label = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"{label}{completion.text}")
            print(f"({len(completion.token_ids)} tokens, finish: {completion.finish_reason})")
    stats = engine.stats()
    print(
        f"{len(outputs)} prompts, {stats.num_generation_tokens} tokens in {elapsed:.2f}s "
        f"({stats.num_generation_tokens / max(elapsed, 1e-9):.1f} tokens/s), {stats.num_steps} steps, "
        f"{stats.num_preemptions} preemptions, {stats.num_prefix_cache_hits} prefix-cache hit tokens",
        file=sys.stderr,
    )
    return 1 if failed else 0


def _as_json(output: RequestOutput) -> dict[str, Any]:
    return {
        "prompt": output.prompt,
        "prompt_token_ids": output.prompt_token_ids,
        "error": output.error,
        "completions": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in output.outputs
        ],
    }
