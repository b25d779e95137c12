"""Reading one tool call, `{"name": "...", "arguments": {...}}` (or `"parameters"`), as its characters
arrive: the name once its string is complete, then the arguments' JSON text piece by piece, as written.

A small JSON scanner (strings, escapes, nesting) that looks only at the call object's own keys; it does
not check the JSON (the grammar or the final parse does). The streams of `tools.ToolCallStream` and the
whole-answer parse both read calls with it, so a streamed call's pieces join to the answer's call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

NAME_KEY = "name"
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class _Value:
    """One value at the call object's own level, read to its end (strings, escapes and nesting)."""

    text: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def ends_before(self, char: str) -> bool:
        """A scalar (number, true, ...) ends before the character after it."""
        return bool(self.text) and self.text[0] not in '"{[' and (char in ",}" or char.isspace())

    def add(self, char: str) -> bool:
        """Add a character; True when it ended the value."""
        self.text += char
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                return self.depth == 0
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


@dataclass
class CallReader:
    """One call object's reader: `feed` it text from its `{` on; it says what became known."""

    opened: bool = False
    done: bool = False  # the call object closed
    expecting_key: bool = True  # at the call's own level: a key comes next (else its value)
    key: str | None = None  # the key a value is read for
    key_string: _Value | None = None  # a key being read
    value: _Value | None = None  # a value being read
    name: str | None = None
    arguments: str | None = None  # the arguments' JSON text so far (None: not started)
    arguments_done: bool = False
    pending: list[str] = field(default_factory=list)  # argument text not taken yet

    def feed(self, text: str) -> int:
        """Read `text`; return how many of its characters belong to this call (all, unless it closed)."""
        for position, char in enumerate(text):
            self._char(char)
            if self.done:
                return position + 1
        return len(text)

    def take_arguments(self) -> str:
        """The argument text read since the last take."""
        piece = "".join(self.pending)
        self.pending.clear()
        return piece

    def _char(self, char: str) -> None:
        if self.value is not None:
            if self.value.ends_before(char):
                self._end_value()
            else:
                self._value_char(char)
                return
        if self.key_string is not None:
            if self.key_string.add(char):
                key = _decoded(self.key_string.text)
                self.key = key if isinstance(key, str) else None
                self.key_string = None
            return
        if not self.opened:
            self.opened = char == "{"
        elif char == '"' and self.expecting_key:
            self.key_string = _Value()
            self.key_string.add(char)
        elif char == ":":
            self.expecting_key = False
        elif char == ",":
            self.expecting_key, self.key = True, None
        elif char == "}":
            self.done = True
        elif not char.isspace() and not self.expecting_key:
            self.value = _Value()
            if self.key in ARGUMENT_KEYS:
                self.arguments = ""
            self._value_char(char)

    def _value_char(self, char: str) -> None:
        assert self.value is not None
        ended = self.value.add(char)
        if self.key in ARGUMENT_KEYS:
            self.arguments = (self.arguments or "") + char
            self.pending.append(char)
        if ended:
            self._end_value()

    def _end_value(self) -> None:
        assert self.value is not None
        if self.key in ARGUMENT_KEYS:
            self.arguments_done = True
        elif self.key == NAME_KEY:
            name = _decoded(self.value.text)
            self.name = name if isinstance(name, str) else None
        self.value = None


def _decoded(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
