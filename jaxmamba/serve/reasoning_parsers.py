"""Reasoning in a thinking model's output (host side): vLLM's `--reasoning-parser`. The
`<think>...</think>` part of a chat completion is its reasoning (`message.reasoning_content`,
and `reasoning`, vLLM's newer name for it), the rest its content, where tool calls are read.

A parser reads one choice's output in the pieces a stream delivers (`feed`, then `finish`) and
splits it the same way however the text is cut. The output starts inside the reasoning unless
the prompt already ended it (`starts_in_reasoning`): a generation prompt that writes
`<think>\\n\\n</think>` (Qwen3's with `enable_thinking: false`), or `qwen3` with
`chat_template_kwargs={"enable_thinking": false}`, gives content only. A `<think>` the model
writes itself at the start is dropped; without `</think>` the whole output is reasoning (it was
cut short).

The parsers, by vLLM's names:

* `deepseek_r1` (DeepSeek-R1, QwQ): `<think>` (often in the prompt) ... `</think>` content
* `qwen3` (Qwen3, Qwen3.5, Qwen3-Next): the same, `enable_thinking: false` honoured, and a
  `<tool_call>` followed by `<function` inside the reasoning ends it there (Qwen3.5 models may
  call a tool without closing their thinking; the call stays in the content)
"""

from __future__ import annotations

import re
from typing import Any

from jaxmamba.serve.tool_parsers import partial_suffix


class ReasoningParser:
    """One choice's output split into (reasoning, content): `feed(text)` for each piece, then
    `finish()`; each returns the reasoning and the content that can be shown now."""

    START = "<think>"
    END = "</think>"
    # Whether `chat_template_kwargs={"enable_thinking": False}` means the output has no reasoning.
    HONOURS_ENABLE_THINKING = False

    def __init__(self, in_reasoning: bool = True):
        self._state = "start" if in_reasoning else "content"
        self._buf = ""  # text not given out yet

    @classmethod
    def starts_in_reasoning(cls, generation_prompt: str, template_kwargs: dict[str, Any]) -> bool:
        """Whether a completion of a prompt whose generation prompt (what the template adds for
        the assistant's turn) is `generation_prompt` begins inside the reasoning."""
        if cls.HONOURS_ENABLE_THINKING and template_kwargs.get("enable_thinking") is False:
            return False
        return generation_prompt.rfind(cls.END) <= generation_prompt.rfind(cls.START)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if self.START.startswith(head):  # may still become the tag: wait
                return "", ""
            if head.startswith(self.START):
                self._buf = head[len(self.START) :]
            self._state = "reasoning"
        if self._state == "reasoning":
            end, after = self._end(self._buf)
            if end < 0:
                cut = len(self._buf) - self._held(self._buf)
                reasoning, self._buf = self._buf[:cut], self._buf[cut:]
                return reasoning, ""
            reasoning, self._buf = self._buf[:end], self._buf[after:]
            self._state = "content"
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The rest: held-back text is reasoning if the reasoning never ended."""
        rest, self._buf = self._buf, ""
        return ("", rest) if self._state == "content" else (rest, "")

    def _end(self, text: str) -> tuple[int, int]:
        """Where the reasoning ends in `text` and where the content starts (-1: not there)."""
        end = text.find(self.END)
        return end, end + len(self.END)

    def _held(self, text: str) -> int:
        """How much of the end of `text` may be the start of the reasoning's end: held back."""
        return partial_suffix(text, self.END)


class DeepSeekR1ReasoningParser(ReasoningParser):
    pass


class Qwen3ReasoningParser(ReasoningParser):
    HONOURS_ENABLE_THINKING = True
    _CALL = "<tool_call>"
    _FUNCTION = "<function"
    _IMPLICIT_END = re.compile(r"<tool_call>\s*<function[\s=]")

    def _end(self, text: str) -> tuple[int, int]:
        end, after = super()._end(text)
        call = self._IMPLICIT_END.search(text, 0, end if end >= 0 else len(text))
        if call is not None:
            return call.start(), call.start()  # the call is content
        return end, after

    def _held(self, text: str) -> int:
        held = super()._held(text)
        start = text.rfind(self._CALL)
        if start >= 0:  # a call tag: is a function tag coming?
            after = text[start + len(self._CALL) :].lstrip()
            if self._FUNCTION.startswith(after):
                held = max(held, len(text) - start)
        return max(held, partial_suffix(text, self._CALL))


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), each None when empty (as vLLM sends them)."""
    reasoning, content = parser.feed(text)
    more, rest = parser.finish()
    return (reasoning + more) or None, (content + rest) or None
