"""Tool calls in a chat model's output (host side): the tool-call formats that the families'
chat templates teach, and the JSON that `tool_choice` "required" or a named function constrains
the output to.

A parser reads the output in the pieces a stream delivers (`feed`, then `finish`) and gives
the same content and calls however the text is cut, so a streamed response reassembles to the
one sent whole. A tagged call is given out when its closing tag arrives (or the output ends):
a streamed call cannot be taken back, and a block that is not a call stays content, verbatim.

The formats, by vLLM's `--tool-call-parser` names:

* `hermes` (Qwen3, Qwen3-Next, Granite 4.0):
  `<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>`
* `qwen3_coder` (Qwen3.5, Nemotron 3):
  `<tool_call>\\n<function=f>\\n<parameter=x>\\n1\\n</parameter>\\n</function>\\n</tool_call>`;
  a value is converted to its parameter's JSON-schema type (text stays a string)
* `nemotron_json` (Nemotron Nano 2): `<TOOLCALL>[{"name": "f", "arguments": {"x": 1}}]</TOOLCALL>`
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`, as a stream sends it: its head (`id` and `name`, arguments
    empty) or a piece of its arguments' JSON text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        """OpenAI's `delta.tool_calls[i]`."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text

    def to_json(self) -> dict[str, Any]:
        """OpenAI's `message.tool_calls[i]`."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


class ToolCallParser:
    """Reads one choice's output: `feed(text)` for each piece, then `finish()`; each returns
    the content that can be shown now and the pieces of calls that are complete."""

    def __init__(self):
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def _call(self, name: str, arguments: str) -> list[ToolCallDelta]:
        index = self.num_calls
        self.num_calls += 1
        head = ToolCallDelta(index, id=new_call_id(), name=name)
        return [head, ToolCallDelta(index, arguments=arguments)]


def parse_tool_calls(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when it is empty and there are calls, as OpenAI sends
    it) and its calls."""
    content, deltas = parser.feed(text)
    rest, more = parser.finish()
    calls = merge_deltas(deltas + more)
    content += rest
    return (None if calls and not content else content), calls


def merge_deltas(deltas: Sequence[ToolCallDelta]) -> list[ToolCall]:
    """The calls that a stream's deltas add up to, by index."""
    heads: dict[int, ToolCallDelta] = {}
    arguments: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            heads[d.index] = d
        arguments.setdefault(d.index, []).append(d.arguments)
    return [ToolCall(heads[i].id, heads[i].name, "".join(arguments[i])) for i in sorted(heads)]


# -- the tagged formats ---------------------------------------------------------------------
class _TaggedParser(ToolCallParser):
    """Calls between `START` and `END` tags, content around them. The whitespace before a call,
    and after the last one, is dropped with the calls (it stays if a block is not a call)."""

    START: str
    END: str

    def __init__(self, tools: Sequence[dict] | None = None):
        super().__init__()
        # name -> the function's parameters schema
        self.parameters = {
            t["name"]: t.get("parameters") or {} for t in tools or () if isinstance(t, dict)
        }
        self._buf = ""  # text not given out yet
        self._inside = False  # after a START whose END has not come
        self._gap = ""  # the whitespace between the content and the open block
        self._just_called = False  # nothing but whitespace since the last call

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        """The (name, arguments text) of the calls in the text between the tags; None if it
        is not calls."""
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._inside:
                end = self._buf.find(self.END)
                if end < 0:
                    break
                block, self._buf = self._buf[:end], self._buf[end + len(self.END) :]
                self._inside = False
                self._close(block, self.END, content, deltas)
                continue
            start = self._buf.find(self.START)
            if start >= 0:
                before = self._buf[:start]
                kept = before.rstrip()
                content.append(kept)
                self._gap = before[len(kept) :]
                self._buf = self._buf[start + len(self.START) :]
                self._inside = True
                continue
            # Hold back what may be the start of a tag, and trailing whitespace (which a call
            # would drop).
            cut = len(self._buf) - partial_suffix(self._buf, self.START)
            kept = self._buf[:cut].rstrip()
            content.append(kept)
            self._just_called = self._just_called and not kept
            self._buf = self._buf[len(kept) :]
            break
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self._inside:  # an unclosed block is a call if it parses (as in vLLM)
            self._inside = False
            self._close(self._buf, "", content, deltas)
        elif self._buf.strip() or not self._just_called:
            content.append(self._buf)
        self._buf = ""
        return "".join(content), deltas

    def _close(self, block: str, end: str, content: list[str], deltas: list[ToolCallDelta]):
        calls = self.parse_block(block)
        if calls:
            for name, arguments in calls:
                deltas += self._call(name, arguments)
            self._just_called = True
        else:
            content.append(self._gap + self.START + block + end)
            self._just_called = False
        self._gap = ""


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (shorter than the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _json_call(obj: Any, key: str) -> tuple[str, str] | None:
    """{"name": str, key: object (or its JSON text)} as (name, arguments text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get(key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class HermesParser(_TaggedParser):
    START, END = "<tool_call>", "</tool_call>"

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        call = _json_call(_loads(block), "arguments")
        return None if call is None else [call]


class NemotronJsonParser(_TaggedParser):
    START, END = "<TOOLCALL>", "</TOOLCALL>"

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        items = _loads(block)
        if isinstance(items, dict):
            items = [items]
        if not isinstance(items, list):
            return None
        calls = [_json_call(item, "arguments") for item in items]
        return None if None in calls else calls


class Qwen3CoderParser(_TaggedParser):
    START, END = "<tool_call>", "</tool_call>"

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        text = block.strip()
        if not text.startswith("<function="):
            return None
        name, sep, body = text[len("<function=") :].partition(">")
        name = name.strip()
        if not sep or not name or "\n" in name:
            return None
        body, _, rest = body.partition("</function>")
        if rest.strip():
            return None
        pieces = body.split("<parameter=")
        if pieces[0].strip():
            return None
        schema = self.parameters.get(name, {})
        properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
        arguments = {}
        for piece in pieces[1:]:
            key, sep, value = piece.partition(">")
            key = key.strip()
            if not sep or not key or "\n" in key:
                return None
            # A missing </parameter> ends at the next parameter, as in vLLM.
            value, _, rest = value.partition("</parameter>")
            if rest.strip():
                return None
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = _typed(value, properties.get(key))
        return [(name, json.dumps(arguments, ensure_ascii=False))]


_JSON_TYPES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says: a string stays text; a number, boolean,
    object or array is its JSON if it parses as one of those types, else the text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kind] if isinstance(kind, str) else list(kind or [])
    if not kinds or ("string" in kinds and not (value == "null" and "null" in kinds)):
        return value
    text = value.strip()
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        parsed = json.loads(text)
    except ValueError:
        return value
    return parsed if any(_JSON_TYPES.get(k, lambda v: False)(parsed) for k in kinds) else value


TOOL_CALL_PARSERS = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "nemotron_json": NemotronJsonParser,
}


def detect_tool_call_parser(template: str | None) -> str | None:
    """The tool-call format a chat template teaches (its tags), or None."""
    if not template:
        return None
    if "<TOOLCALL>" in template:
        return "nemotron_json"
    if "<tool_call>" in template:
        return "qwen3_coder" if "<function=" in template else "hermes"
    return None


def tool_call_tags(parser: str) -> tuple[str, str]:
    cls = TOOL_CALL_PARSERS[parser]
    return cls.START, cls.END


# -- the constrained shapes -----------------------------------------------------------------
class RequiredToolCalls(ToolCallParser):
    """`tool_choice: "required"`: the output is `[{"name": ..., "parameters": {...}}, ...]`
    (the grammar makes it so); each item is a call once it is complete. Text that is not
    (a generation cut by max_tokens) is content."""

    def __init__(self):
        super().__init__()
        self._buf = ""
        self._pos = 0  # what is parsed
        self._tried = 0  # the buffer before this holds no '}' the open item could end at
        self._state = "open"  # open, first, item, separator, closed, bad

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        deltas: list[ToolCallDelta] = []
        while self._state not in ("closed", "bad"):
            pos = len(self._buf) - len(self._buf[self._pos :].lstrip())
            if pos == len(self._buf):
                break
            char = self._buf[pos]
            if self._state == "open":
                self._state, self._pos = ("first", pos + 1) if char == "[" else ("bad", pos)
            elif self._state == "separator" or self._state == "first" and char == "]":
                if char not in ",]":
                    self._state = "bad"
                    break
                self._state, self._pos = ("item" if char == "," else "closed"), pos + 1
            else:  # an item: try it once a '}' has come since the last try
                if "}" not in self._buf[max(pos, self._tried) :]:
                    break
                self._tried = len(self._buf)
                try:
                    item, end = _DECODER.raw_decode(self._buf, pos)
                except ValueError:
                    break
                call = _json_call(item, "parameters")
                if call is None:
                    self._state = "bad"
                    break
                deltas += self._call(*call)
                self._state, self._pos, self._tried = "separator", end, end
        return "", deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        rest = self._buf[self._pos :]
        self._buf, self._pos, self._tried = "", 0, 0
        return (rest if rest.strip() else ""), []


class NamedToolCall(ToolCallParser):
    """A named `tool_choice`: the whole output is the arguments of that function."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        deltas = self._call(self.name, "")[:1] if self.num_calls == 0 else []
        if text:
            deltas.append(ToolCallDelta(0, arguments=text))
        return "", deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.feed("")
