"""Speculative decoding on an input-grounded workload: tokens/s without it, with n-gram prompt lookup and
(with --draft-model) with a draft model.

Each request asks the chat model to correct the spelling of a given passage (its answer repeats most of
the passage, so proposals looked up in the prompt are often right). Greedy, answers up to --max-tokens
(or EOS). The engines share one loaded model (speculation off / ngram / draft); each round runs the
workload on each, alternating, so machine load hits all alike. At concurrency 1 the requests run one at a
time; at concurrency C, C at once. Asserts that every engine emits identical tokens (greedy; with
--temperature > 0 each request has its own seed and the systems' tokens may differ: a draft model's
rejection sampling keeps the distribution, not the tokens).

    PYTHONPATH=. .venv/bin/python benchmarks/speculative_decoding.py --model builtin:smollm2 \\
        --dtype float32 --concurrency 1 64 [--rounds 2] [--max-tokens 128] [--threads N]
        [--task edit|poem]
        [--speculative-max-running N] [--draft-model PATH] [--systems off ngram draft] [--step-times]

--step-times also prints, per concurrency and system, the target model's steps over all rounds by kind
(prompt, decode, verify): how many, their time, and the most common row count's time a step.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import torch

from inflight.checkpoints.resolve import resolve_model
from inflight.engine import runner
from inflight.engine.attention.metadata import SHORT_QUERY_LEN
from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.sequence import SamplingParams

PASSAGES = [
    "The river town woke slowly. Fishermen carried their nets down to the water while the baker opened "
    "his shutters and the smell of fresh bread drifted along the narow streets. By seven the market "
    "square was full of voices, carts and dogs looking for scraps.",
    "Solar panels convert sunlight directly into electricity. When light strikes the silicon cells, it "
    "knocks electrons loose, and the resulting current is collected by thin metal contacts. Panels work "
    "best when they face the sun and are kept free of dust and shade.",
    "To make a simple tomato sauce, warm olive oil in a pan, add chopped garlic and cook it until it is "
    "fragrant but not brown. Pour in the crushed tomatos, season with salt, and let the sauce simmer for "
    "twenty minutes, stirring now and then.",
    "The library will be closed on Monday for maintenance. Books that are due on that day may be "
    "returned on Tuesday without a late fee. The reading room on the second floor will reopen on "
    "Wednesday after the new lights have been instaled.",
    "Honey bees live in colonies of many thousands. The queen lays the eggs, the workers gather nectar "
    "and pollen, clean the hive and care for the young, and the drones exist mainly to mate with a "
    "queen. In winter the bees cluster together to keep warm.",
    "Our team meeting has been moved from Thursday to Friday at ten in the morning. Please bring your "
    "progress reports and any questions about the new schedule. Lunch will be provided after the "
    "meeting in the small conference room next to the kitchen.",
    "A good night's sleep helps the body recover and the mind stay sharp. Experts recomend going to bed "
    "at the same time every night, keeping the bedroom dark and cool, and avoiding screens for an hour "
    "before sleep.",
    "The old lighthouse stands on a rocky point at the edge of the bay. For more than a hundred years its "
    "lamp guided ships safely past the reef. Today it is a small museum, and visitors can climb the "
    "spiral stairs to the top for a view of the coast.",
]


def prompts(engine: LLMEngine, count: int, task: str) -> list[str]:
    out = []
    for i in range(count):
        passage = PASSAGES[i % len(PASSAGES)]
        # Requests beyond the passages differ in their first line (no two prompts are the same).
        if task == "edit":
            message = (
                f"Request {i}. Correct the spelling in the following text and reply with the corrected "
                f"text only.\n\n{passage}"
            )
        else:  # free writing about the passage's subject: little of the answer is in the prompt
            message = f"Request {i}. Write a short poem inspired by this text.\n\n{passage}"
        out.append(engine.tokenizer.apply_chat_template([{"role": "user", "content": message}]))
    return out


class StepTimes:
    """With --step-times: the wall time of each target-model step (`runner.run_model`), by the engine
    running it and the step's kind: prompt (a sequence with more than SHORT_QUERY_LEN new rows), decode
    (one row a sequence) or verify (a few rows a sequence), and its rows."""

    def __init__(self) -> None:
        self.engine = ""
        self.seconds: dict[tuple[str, str, int], list[float]] = defaultdict(list)
        original = runner.run_model

        def timed(*args: Any, **kwargs: Any) -> torch.Tensor | None:
            inputs: runner.StepInputs = args[2]
            start = time.perf_counter()
            out = original(*args, **kwargs)
            longest = max(inputs.query_lens, default=0)
            kind = "prompt" if longest > SHORT_QUERY_LEN else "decode" if longest == 1 else "verify"
            self.seconds[(self.engine, kind, sum(inputs.query_lens))].append(time.perf_counter() - start)
            return out

        runner.run_model = timed

    def report(self) -> None:
        by_kind: dict[tuple[str, str], list[tuple[int, list[float]]]] = defaultdict(list)
        for (engine, kind, rows), seconds in sorted(self.seconds.items()):
            by_kind[(engine, kind)].append((rows, seconds))
        for (engine, kind), entries in sorted(by_kind.items()):
            steps = sum(len(seconds) for _, seconds in entries)
            total = sum(sum(seconds) for _, seconds in entries)
            common = max(entries, key=lambda entry: len(entry[1]))
            print(
                f"  {engine} {kind} steps: {steps}, {total:.3f} s in all; most often {common[0]} rows, "
                f"{sum(common[1]) / len(common[1]) * 1e3:.2f} ms each ({len(common[1])} steps)"
            )
        self.seconds.clear()


def run(
    engine: LLMEngine, texts: list[str], concurrency: int, max_tokens: int, temperature: float = 0.0
) -> tuple[float, list[list[int]]]:
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i) for i in range(len(texts))
    ]
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(texts), concurrency):
        outputs = engine.generate(texts[first : first + concurrency], params[first : first + concurrency])
        tokens += [o.outputs[0].token_ids for o in outputs]
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--task",
        choices=["edit", "poem"],
        default="edit",
        help="edit: correct the passage (input-grounded); poem: write about it (few proposals hit)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--requests-at-1", type=int, default=8, help="requests at concurrency 1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    defaults = EngineConfig()
    parser.add_argument("--num-speculative-tokens", type=int, default=defaults.num_speculative_tokens)
    parser.add_argument(
        "--speculative-max-running",
        type=int,
        default=defaults.speculative_max_running,
        help="the engine's switch-off rule (raise it to measure speculation on larger batches)",
    )
    parser.add_argument(
        "--draft-model", help="a draft model (folder, .gguf, builtin:NAME) for the draft system"
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=["off", "ngram", "draft"],
        default=["off", "ngram"],
        help="what to compare (the first is the baseline of the ratios; draft needs --draft-model)",
    )
    parser.add_argument(
        "--step-times",
        action="store_true",
        help="also print each system's model steps by kind (prompt, decode, verify): count and time",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    # No prefix cache: every round computes its prompts as the first did. With it, a later round's prompts
    # come from the cache and only their last rows are computed, in steps of other sizes, whose float32
    # products may differ from the first round's in the last bits; a near-tie then flips a greedy token
    # (seen at 64 at once), and the rounds would time cache hits rather than speculation.
    base = {
        "dtype": args.dtype,
        "device": "cpu",
        "max_num_seqs": max(args.concurrency),
        "enable_prefix_caching": False,
    }
    speculation = {
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_max_running": args.speculative_max_running,
    }
    settings = {
        "off": {},
        "ngram": {"speculative": "ngram", **speculation},
        "draft": {
            "speculative": "draft",
            "draft_model": str(resolve_model(args.draft_model)) if args.draft_model else None,
            **speculation,
        },
    }
    engines: dict[str, LLMEngine] = {}
    for name in args.systems:
        first = next(iter(engines.values()), None)
        engines[name] = LLMEngine(model, EngineConfig(**base, **settings[name]), share_model_of=first)
    print(
        f"{args.model} {args.dtype}, {args.threads} threads, temperature {args.temperature}, "
        f"task {args.task}, "
        f"up to {args.max_tokens} tokens per answer, draft model {args.draft_model}"
    )
    baseline = args.systems[0]
    step_times = StepTimes() if args.step_times else None
    for concurrency in args.concurrency:
        texts = prompts(engines[baseline], args.requests_at_1 if concurrency == 1 else concurrency, args.task)
        for engine in engines.values():
            run(engine, texts[:1], 1, 8)  # warm-up
        if step_times is not None:
            step_times.seconds.clear()
        rates: dict[str, list[float]] = {name: [] for name in engines}
        results: dict[str, list[list[int]]] = {}
        drafted = dict.fromkeys(engines, 0)
        accepted = dict.fromkeys(engines, 0)
        for _ in range(args.rounds):
            for name, engine in engines.items():
                if step_times is not None:
                    step_times.engine = name
                before = engine.stats()
                seconds, tokens = run(engine, texts, concurrency, args.max_tokens, args.temperature)
                after = engine.stats()
                rates[name].append(sum(map(len, tokens)) / seconds)
                results.setdefault(name, tokens)
                assert tokens == results[name], "greedy or seeded tokens changed between rounds"
                drafted[name] += after.num_draft_tokens - before.num_draft_tokens
                accepted[name] += after.num_accepted_tokens - before.num_accepted_tokens
        identical = all(tokens == results[baseline] for tokens in results.values())
        print(
            f"concurrency {concurrency}: {len(texts)} requests, {sum(map(len, results[baseline]))} tokens; "
            f"identical tokens: {identical}"
        )
        for name in engines:
            ratio = [b / a for a, b in zip(rates[baseline], rates[name], strict=True)]
            print(
                f"  {name}: {sum(map(len, results[name]))} tokens, "
                f"{', '.join(f'{r:.1f}' for r in rates[name])} tok/s; "
                f"vs {baseline} per round {', '.join(f'{r:.2f}x' for r in ratio)}; "
                f"proposed {drafted[name]}, accepted {accepted[name]}"
            )
        if step_times is not None:
            step_times.report()
        if args.temperature == 0:
            assert identical, "speculative decoding changed greedy tokens"


if __name__ == "__main__":
    main()
