"""Grammars for structured outputs (host side), on llguidance: the vocabulary as the grammar
engine sees it, the grammar of a `StructuredOutputsParams`, and the compiler that builds each
grammar once and caches it by its key.

llguidance over xgrammar (docs/structured_outputs.md, `scripts/bench_grammar.py`): it refuses
the JSON-schema keywords it cannot enforce instead of ignoring them, compiles in about a
millisecond (no per-grammar token tables), masks regexes and grammars faster, and needs no
torch. Compiling here is validating the grammar and building a pristine matcher; a request's
`GrammarMatcher` starts from a copy of it, which shares its lexer.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np

from jaxmamba.structured.bitmask import bitmask_words
from jaxmamba.structured.params import StructuredOutputsParams
from jaxmamba.tokenizer import byte_level_chars

# Errors say what is wrong, without the parser's state dump.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


@dataclass(frozen=True)
class GrammarVocab:
    """The vocabulary as the grammar engine sees it, built once per model.

    `vocab_size` is the model's (the bitmask's width, W = ceil(vocab_size / 32) words); ids
    from `tokenizer_size` on are padding rows of the embedding and never allowed. `eos_ids`
    end every grammar: a finished grammar allows only them (and a request's stop ids)."""

    tokenizer: llguidance.LLTokenizer
    vocab_size: int
    tokenizer_size: int
    eos_ids: tuple[int, ...]

    @property
    def words(self) -> int:
        return bitmask_words(self.vocab_size)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> GrammarVocab:
        """From a `jaxmamba.tokenizer` tokenizer (HF `tokenizer.json` or the byte presets'), a
        `tokenizers.Tokenizer`, a transformers fast tokenizer, or tokenizer.json text. Raises
        ValueError for a tokenizer whose token bytes llguidance cannot recover (then no
        request can be constrained)."""
        from jaxmamba.tokenizer import ByteTokenizer

        eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        if not eos_ids or not all(0 <= i < vocab_size for i in eos_ids):
            raise ValueError(f"eos_ids must be ids in [0, {vocab_size}), got {list(eos_ids)}")
        if isinstance(tokenizer, ByteTokenizer):
            source = llguidance.TokenizerWrapper(_ByteTokens(tokenizer, vocab_size))
        else:
            source = _added_tokens_as_text(_tokenizer_json(tokenizer))
        try:
            ll = llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=list(eos_ids))
        except Exception as e:  # llguidance raises ValueError, or a bare Exception from Rust
            raise ValueError(f"structured outputs cannot use this tokenizer: {e}") from e
        if ll.vocab_size != vocab_size:
            raise ValueError(
                f"the tokenizer has {ll.vocab_size} ids, more than the model's vocabulary "
                f"({vocab_size})"
            )
        return cls(ll, vocab_size, _tokenizer_size(tokenizer, source), eos_ids)


class _ByteTokens:
    """`ByteTokenizer`'s vocabulary for `llguidance.TokenizerWrapper`: ids 0..255 are bytes,
    the rest specials, padded with empty tokens to the model's vocabulary."""

    def __init__(self, tok, vocab_size: int):
        specials = [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]
        self.tokens = [bytes([i]) for i in range(256)]
        self.tokens += [tok.convert_ids_to_tokens(i).encode() for i in range(256, tok.vocab_size)]
        self.tokens += [b""] * (vocab_size - len(self.tokens))
        self.special_token_ids = [i for i in specials if i is not None]
        self.eos_token_id, self.bos_token_id = tok.eos_token_id, tok.bos_token_id

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def _tokenizer_json(tokenizer) -> str:
    if isinstance(tokenizer, str):
        return tokenizer
    # transformers' fast tokenizers, `jaxmamba.tokenizer.HFTokenizer`, `tokenizers.Tokenizer`
    for backend in (
        getattr(tokenizer, "backend_tokenizer", None),
        getattr(tokenizer, "_tok", None),
        tokenizer,
    ):
        if backend is not None and hasattr(backend, "to_str"):
            return backend.to_str()
    raise ValueError(
        f"structured outputs need a tokenizer.json tokenizer or the byte tokenizer, got "
        f"{type(tokenizer).__name__}"
    )


def _added_tokens_as_text(source: str) -> str:
    """tokenizer.json text whose added tokens that are not special (Qwen's `<think>` and
    `<tool_call>`: decoding keeps them) are ordinary vocabulary entries. llguidance takes every
    added token for a special one (its bytes are not text to the grammar), yet offers it where
    a grammar forces its text, and then refuses it: a request constrained to write the tag
    would end in an error."""
    spec = json.loads(source)
    model = spec.get("model") or {}
    added = [t for t in spec.get("added_tokens") or () if not t.get("special", True)]
    if not added or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return source
    if "ByteLevel" in json.dumps(spec.get("decoder")):
        chars = byte_level_chars()
        spell = lambda text: "".join(chars[b] for b in text.encode("utf-8"))  # noqa: E731
    elif model.get("byte_fallback"):  # SentencePiece: spaces are "▁"
        spell = lambda text: text.replace(" ", "\u2581")  # noqa: E731
    else:
        return source
    vocab = model["vocab"]
    for token in added:
        if spell(token["content"]) not in vocab:
            vocab[spell(token["content"])] = token["id"]
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t not in added]
    return json.dumps(spec, ensure_ascii=False)


def _tokenizer_size(tokenizer, source) -> int:
    if hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        return tokenizer.get_vocab_size(with_added_tokens=True)
    if hasattr(tokenizer, "__len__") and not isinstance(tokenizer, str):
        return len(tokenizer)  # transformers and jaxmamba tokenizers: added tokens included
    from tokenizers import Tokenizer

    return Tokenizer.from_str(source).get_vocab_size(with_added_tokens=True)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params` (no tokenizer needed). Raises ValueError for a
    grammar llguidance cannot parse."""
    kind, text, (no_whitespace, no_additional, whitespace_pattern, _) = params.key
    if kind in ("json", "json_object"):
        options = {"whitespace_flexible": not no_whitespace}
        if whitespace_pattern is not None:
            options["whitespace_pattern"] = whitespace_pattern
        schema = json.loads(text) if kind == "json" else {"type": "object"}
        if schema is False:
            raise ValueError("structured_outputs.json: the schema is false (nothing satisfies it)")
        if schema is True:
            schema = {}
        if no_additional:
            schema = _no_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    try:
        return llguidance.grammar_from(kind, text)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind}: {e}") from None


def validate(params: StructuredOutputsParams) -> None:
    """Raises ValueError, naming the problem, if `params` is not a grammar the engine can
    enforce: a malformed schema, regex or grammar, a JSON-schema keyword llguidance does not
    implement (never ignored). About a millisecond; no tokenizer. Unsatisfiable schemas show
    when compiled (`GrammarCompiler`), a few only midway (`GrammarMatcher.error`)."""
    grammar = grammar_text(params)
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=_LIMITS)
    if error:
        raise ValueError(f"structured_outputs.{params.kind}: {error_text(error)}")


class CompiledGrammar:
    """A validated grammar for one vocabulary; immutable and shared by every request with the
    same `StructuredOutputsParams.key`."""

    def __init__(self, params: StructuredOutputsParams, vocab: GrammarVocab):
        self.key = params.key
        self.vocab = vocab
        self.reasoning_end_ids = params.reasoning_end_ids
        self.grammar = grammar_text(params)
        self._template = llguidance.LLMatcher(
            vocab.tokenizer, self.grammar, log_level=0, limits=_LIMITS
        )
        # Some errors (an unsatisfiable schema) show only once the first mask is computed; the
        # copies then start from a warm lexer.
        scratch = np.zeros((1, vocab.words), np.int32)
        if not self._template.is_error():
            self._template.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if self._template.is_error():
            raise ValueError(
                f"structured_outputs.{params.kind}: {error_text(self._template.get_error())}"
            )

    def new_matcher(self) -> llguidance.LLMatcher:
        """A fresh llguidance matcher at the grammar's start (`GrammarMatcher` wraps it)."""
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` into `CompiledGrammar`s, each key once, and keeps the
    last `max_cached` (least recently used out first). Thread-safe.

    `submit` compiles on a background thread and returns a `Future`; requests with the same
    key share one compile. The engine loop never waits on it: it calls `validate` when a
    request arrives (a bad grammar fails the request there), keeps the request from sampling
    until `future.done()`, then takes `future.result()`. The vocabulary is built by `prepare`
    or the first compile, on the thread that compiles (1.0-1.2 s for 65,536 ids on a 2-core
    CPU, docs/structured_outputs.md)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_ids: Sequence[int],
        *,
        max_cached: int = 256,
        threads: int = 1,
    ):
        if max_cached < 1:
            raise ValueError(f"max_cached must be >= 1, got {max_cached}")
        self._tokenizer, self._vocab_size, self._eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self._vocab: GrammarVocab | None = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._vocab_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self.max_cached = max_cached
        self.num_compiles = 0

    @property
    def vocab(self) -> GrammarVocab:
        with self._vocab_lock:
            if self._vocab is None:
                self._vocab = GrammarVocab.from_tokenizer(
                    self._tokenizer, self._vocab_size, self._eos_ids
                )
            return self._vocab

    def prepare(self) -> Future:
        """Builds the vocabulary on the compile thread now (engine start-up), so that the
        first constrained request does not wait for it."""
        return self._pool.submit(lambda: self.vocab)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar, compiled on this thread unless cached or under way. Raises
        ValueError for a grammar the engine cannot enforce."""
        future, new = self._entry(params)
        if new:
            self._run(params, future)
        return future.result()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (its `result()` raises ValueError for a grammar the
        engine cannot enforce)."""
        future, new = self._entry(params)
        if new:
            self._pool.submit(self._run, params, future)
        return future

    def cached(self, params: StructuredOutputsParams) -> bool:
        with self._lock:
            return params.key in self._cache

    def close(self) -> None:
        """Stops the compile thread; compiles not finished fail with RuntimeError."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            pending = [f for f in self._cache.values() if not f.done()]
        for future in pending:
            _settle(future, error=RuntimeError("the grammar compiler was closed"))

    def _entry(self, params: StructuredOutputsParams) -> tuple[Future, bool]:
        with self._lock:
            future = self._cache.get(params.key)
            if future is not None:
                self._cache.move_to_end(params.key)
                return future, False
            future = self._cache[params.key] = Future()
            future.set_running_or_notify_cancel()
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            self.num_compiles += 1
            return future, True

    def _run(self, params: StructuredOutputsParams, future: Future) -> None:
        try:
            _settle(future, result=CompiledGrammar(params, self.vocab))
        except Exception as e:  # the future carries it to whoever waits
            _settle(future, error=e)


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Completes `future` unless `close` did first."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


# JSON-schema keywords whose values are schemas, lists of schemas, and maps to schemas.
_SUBSCHEMA = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _no_additional_properties(schema):
    """`schema` with `additionalProperties: false` on every object schema that lists
    properties and does not say (vLLM's `disable_additional_properties`); `const`, `enum` and
    `default` values are left alone."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k, v in schema.items():
        if k in _SUBSCHEMA_LISTS and isinstance(v, list):
            out[k] = [_no_additional_properties(s) for s in v]
        elif k in _SUBSCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _no_additional_properties(s) for name, s in v.items()}
        elif k in _SUBSCHEMA:
            out[k] = _no_additional_properties(v)
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def error_text(error: str) -> str:
    """An llguidance error message without the parser's state dump."""
    return error.split("<state>")[0].split("<non-verbose/>")[0].strip()
