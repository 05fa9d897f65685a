"""One request's position in its grammar (host side): the bitmask of the tokens it may sample
next, and the tokens it sampled.

Stop tokens: the vocabulary's eos ids and the request's stop ids are allowed exactly where the
grammar may end, and nowhere else (a stop id that is also ordinary text would otherwise end the
output mid-grammar). Accepting one terminates the matcher; a terminated matcher allows only the
stop tokens. Padding ids (past the tokenizer's vocabulary) are never allowed.

Reasoning: a grammar compiled with `reasoning_end_ids` starts just after the output writes
them (a reasoning model's end-of-thinking tag). Until then every token is allowed and none
reaches the grammar, and a stop token ends the output there (vLLM's structured outputs with
a reasoning parser, `enable_in_reasoning` off).
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np

from jaxmamba.structured.bitmask import set_bits, word_bits
from jaxmamba.structured.grammar import CompiledGrammar, error_text


class GrammarMatcher:
    """One request's (one sample's) matcher, at the start of `compiled`; `stop_ids`: the
    request's stop token ids besides the vocabulary's eos ids. Used by one thread at a time
    (the engine loop's)."""

    def __init__(self, compiled: CompiledGrammar, stop_ids: Sequence[int] = ()):
        vocab = compiled.vocab
        self.compiled, self.vocab = compiled, vocab
        self._m = compiled.new_matcher()
        stop_ids = [int(i) for i in stop_ids]
        if not all(0 <= i < vocab.vocab_size for i in stop_ids):
            raise ValueError(f"stop ids must be in [0, {vocab.vocab_size}), got {stop_ids}")
        self.stop_ids = tuple(sorted({*vocab.eos_ids, *stop_ids}))
        self._stop_set = frozenset(self.stop_ids)
        self._eos = vocab.eos_ids[0]
        # Precomputed (words, bits) for `_finish_row`: None where there is nothing to do.
        extra = sorted(set(stop_ids) - set(vocab.eos_ids))
        self._eos_bits = word_bits(vocab.eos_ids)
        self._extra_bits = word_bits(extra) if extra else None
        self._pad = None
        if vocab.tokenizer_size < vocab.vocab_size:
            first = vocab.tokenizer_size // 32
            keep = np.zeros(vocab.words - first, np.int32)
            set_bits(keep, np.arange(first * 32, vocab.tokenizer_size) - first * 32, True)
            self._pad = (slice(first, vocab.words), keep)
        self._terminated = False
        # The reasoning tokens, before the grammar started (None: it starts at once).
        self._end = compiled.reasoning_end_ids
        self._reasoning: list[int] | None = [] if self._end else None
        self._started = not self._end
        self._grammar_tokens = 0  # consumed by llguidance, a recorded stop token excluded
        # llguidance records an eos it consumes, except once the grammar has stopped (nothing
        # but eos may follow): then the stop token is ours alone, and rollback must know.
        self._stop_recorded = False
        self.num_tokens = 0  # accepted, the stop token included

    def fill_bitmask(self, out: np.ndarray, row: int = 0) -> None:
        """Writes the tokens allowed next into `out[row]` (`out`: int32 `[R, W]`, C-contiguous,
        any R: a view into the step's packed input works). For a step's rows,
        `fill_bitmasks` does the same with less overhead per row."""
        fill_bitmasks([self], out, [row])

    def accept_token(self, token_id: int) -> bool:
        """Advances past `token_id` if the grammar allows it there; False (and no change) if
        not. A stop token is allowed where the grammar may end, and terminates the matcher."""
        if self._terminated:
            return False
        if not self._started:
            if token_id in self._stop_set:
                self._terminated, self._stop_recorded = True, False
            else:
                self._reasoning.append(token_id)
                self._started = tuple(self._reasoning[-len(self._end) :]) == self._end
            self.num_tokens += 1
            return True
        if token_id in self._stop_set:
            if self._m.is_error():
                return False
            if self._m.is_stopped():
                self._stop_recorded = False
            elif self._m.validate_tokens([self._eos]) == 1 and self._m.consume_token(self._eos):
                self._stop_recorded = True
            else:
                return False
            self._terminated = True
        elif self._m.validate_tokens([token_id]) != 1 or not self._m.consume_token(token_id):
            return False
        else:
            self._grammar_tokens += 1
        self.num_tokens += 1
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, from the first, the grammar would accept in turn (counting
        stops at a stop token, itself included); nothing changes. For checking a draft."""
        if self._terminated:
            return 0
        ids = [int(t) for t in token_ids]
        if self._started:
            return self._validate_grammar(ids)
        window, n = self._reasoning[-len(self._end) :], len(self._end)
        for i, t in enumerate(ids):
            if t in self._stop_set:
                return i + 1
            window = [*window[1 - n :], t] if n > 1 else [t]
            if tuple(window) == self._end:
                return i + 1 + self._validate_grammar(ids[i + 1 :])
        return len(ids)

    def _validate_grammar(self, ids: list[int]) -> int:
        if not ids:
            return 0
        cut = next((i for i, t in enumerate(ids) if t in self._stop_set), len(ids))
        n = self._m.validate_tokens(ids[:cut]) if cut else 0
        if n < cut or cut == len(ids):
            return n
        # Every token before the stop is valid: may the grammar end after them?
        if cut and not self._m.consume_tokens(ids[:cut]):
            raise RuntimeError(f"llguidance refused tokens it validated: {self._m.get_error()}")
        may_end = self._m.is_stopped() or self._m.validate_tokens([self._eos]) == 1
        if cut and not self._m.rollback(cut):
            raise RuntimeError(f"llguidance could not roll back: {self._m.get_error()}")
        return cut + may_end

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted (the grammar is complete)."""
        return self._terminated

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on (a schema that recurses without end, a parser limit
        hit), or None. Its bitmask row then allows nothing: the engine must end the request
        with this error rather than sample the row."""
        if not self._started or not self._m.is_error():
            return None
        why = error_text(self._m.get_error())
        return f"the grammar cannot go on after {self.num_tokens} tokens ({why})"

    def must_stop(self) -> bool:
        """Whether only a stop token may come next (the grammar is complete and cannot go on),
        or one came already: the engine may finish the request now rather than sample the
        stop token, and must not mask the stop ids for min_tokens."""
        return self._terminated or (
            self._started and self._m.is_stopped() and not self._m.is_error()
        )

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (a rejected draft's)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"can roll back 0..{self.num_tokens} tokens, got {num_tokens}")
        inner = 0  # llguidance's tokens to undo
        for _ in range(num_tokens):
            if self._terminated:
                self._terminated = False
                inner += self._stop_recorded
            elif self._grammar_tokens:
                self._grammar_tokens -= 1
                inner += 1
            else:  # a reasoning token (the grammar had not started before it)
                self._started = False
                self._reasoning.pop()
        if inner and not self._m.rollback(inner):
            raise RuntimeError(f"llguidance could not roll back: {self._m.get_error()}")
        self.num_tokens -= num_tokens

    def _finish_row(self, line: np.ndarray) -> None:
        """The request's stop ids where the grammar may end (where llguidance set an eos), no
        padding ids."""
        if self._extra_bits is not None:
            words, bits = self._extra_bits
            if (line[self._eos_bits[0]] & self._eos_bits[1]).any():
                line[words] |= bits
            else:
                line[words] &= ~bits
        if self._pad is not None:
            line[self._pad[0]] &= self._pad[1]


def fill_bitmasks(
    matchers: Sequence[GrammarMatcher],
    out: np.ndarray,
    rows: Sequence[int],
    executor: llguidance.LLExecutor | None = None,
) -> None:
    """`matchers[i].fill_bitmask(out, rows[i])` for every i; with an `llguidance.LLExecutor`,
    the grammar work of all rows runs in its threads (the GIL released). On two cores the
    plain loop is as fast (docs/structured_outputs.md); the executor pays off with more."""
    if len(matchers) != len(rows):
        raise ValueError(f"one row per matcher: {len(matchers)} matchers, {len(rows)} rows")
    if not matchers:
        return
    vocab = matchers[0].vocab
    if any(m.vocab is not vocab for m in matchers):
        raise ValueError("fill_bitmasks: the matchers belong to different vocabularies")
    _check_bitmask(out, vocab.words, rows)
    live = []
    for m, row in zip(matchers, rows, strict=True):
        if m._terminated:
            out[row] = 0
            set_bits(out[row], m.stop_ids, True)
        elif not m._started:
            out[row] = -1  # reasoning: unconstrained
        else:
            live.append((m, row))
    nbytes = vocab.words * 4
    base = out.ctypes.data  # once: it costs microseconds
    if executor is not None and len(live) > 1:
        executor.unsafe_compute_mask_ptr(
            [(m._m, row) for m, row in live], base, nbytes, out.shape[0]
        )
    else:
        for m, row in live:
            m._m.unsafe_compute_mask_ptr(base + row * nbytes, nbytes)
    for m, row in live:
        if m._m.is_error():
            out[row] = 0  # llguidance's mask would allow eos: ending mid-grammar
        else:
            m._finish_row(out[row])


def _check_bitmask(out: np.ndarray, words: int, rows: Sequence[int]) -> None:
    if out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != words:
        raise ValueError(
            f"the bitmask must be int32 [rows, {words}], got {out.dtype} {list(out.shape)}"
        )
    if not out.flags.c_contiguous:
        raise ValueError("the bitmask must be C-contiguous (the grammar engine writes rows)")
    bad = [r for r in rows if not 0 <= r < out.shape[0]]
    if bad:
        raise ValueError(f"bitmask rows must be in [0, {out.shape[0]}), got {bad}")
