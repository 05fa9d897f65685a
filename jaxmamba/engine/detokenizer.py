"""Incremental detokenization and stop strings for one output sequence (host side).

Text is handed out only once it is final: a token that ends inside a multi-byte character
(its decode ends in U+FFFD) waits for the tokens that complete it, and with stop strings the
last `len(longest stop) - 1` characters wait until they cannot be the start of one. So the
deltas, concatenated, are the final text.

Each step decodes a short window: the tokens since the previous emission plus the ones
before it as context (`prefix_offset:read_offset`), so tokenizers whose decode depends on the
neighbouring token (a leading space) give the same text as one decode of everything.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.hold_back = max(map(len, stop)) - 1 if stop and not include_stop_str_in_output else 0
        self.token_ids: list[int] = []  # the tokens whose text is in `text`
        self.num_output_tokens = 0
        self.text = ""  # decoded so far (cut at a stop string once one is found)
        self.stop_string: str | None = None
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], stopped_on_token: bool) -> str | None:
        """Add the step's new tokens; returns the stop string they completed, if any.

        `stopped_on_token`: the last token is an eos or stop token, whose text is left out
        unless `include_stop_str_in_output`.
        """
        self.num_output_tokens += len(new_token_ids)
        if stopped_on_token and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        before = len(self.text)
        for token in new_token_ids:
            self.token_ids.append(token)
            self.text += self._decode_next(final=False)
        if stopped_on_token:
            self.text += self._decode_next(final=True)
            return None  # a stop token ended it: vLLM checks no stop strings then
        if self.stop and self.num_output_tokens > self.min_tokens:
            self.stop_string = self._find_stop(len(self.text) - before)
        return self.stop_string

    def flush(self) -> None:
        """The sequence ended: decode what waited for more bytes."""
        if self.stop_string is None:
            self.text += self._decode_next(final=True)

    def take_delta(self, finished: bool) -> str:
        """Text not handed out before (all of it once the sequence has finished)."""
        end = len(self.text) if finished else max(len(self.text) - self.hold_back, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _decode_next(self, *, final: bool) -> str:
        ids = self.token_ids
        if self._read_offset == len(ids):
            return ""
        prefix = self.decode(ids[self._prefix_offset : self._read_offset])
        full = self.decode(ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not final):
            if final:
                self._prefix_offset = self._read_offset = len(ids)
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full[len(prefix) :]

    def _find_stop(self, num_new_chars: int) -> str | None:
        """vLLM's `check_stop_strings`: the first stop string, in the order of `stop`, that
        occurs in the new text (or straddles its start); the text is cut before it, or after
        it with `include_stop_str_in_output`."""
        text = self.text
        for s in self.stop:
            i = text.find(s, max(len(text) - num_new_chars - len(s) + 1, 0))
            if i >= 0:
                self.text = text[: i + len(s) if self.include_stop_str_in_output else i]
                return s
        return None
