"""The tool-call output parsers: the names `inflight serve --tool-call-parser` offers and how "auto"
picks one from the chat template. One list for the flag, the server and the docs.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen 2.5, and the
  built-in tool prompt format for templates without tool support);
- `llama3_json`: Llama 3.1's bare `{"name": ..., "parameters": {...}}` objects (`;`-separated, optionally
  after `<|python_tag|>`).
"""

from __future__ import annotations

from typing import Literal, get_args

ParserName = Literal["hermes", "llama3_json"]
ParserChoice = Literal["auto", "hermes", "llama3_json"]
PARSER_CHOICES: tuple[ParserChoice, ...] = get_args(ParserChoice)
LLAMA3_PYTHON_TAG = "<|python_tag|>"


def parser_for(choice: ParserChoice, template: str | None) -> ParserName:
    """The parser to use: the chosen one, or for "auto" the template's family (Llama 3.1's JSON when
    the template knows `<|python_tag|>`, else `<tool_call>` blocks)."""
    if choice != "auto":
        return choice
    return "llama3_json" if template is not None and LLAMA3_PYTHON_TAG in template else "hermes"
