"""Grammar engines for structured outputs, side by side on the host: xgrammar and llguidance
(docs/structured_outputs.md has the figures and the choice).

The tokenizer is a byte-level BPE (GPT-2's pre-tokenizer and byte map, like Qwen's and
Nemotron's) trained by the `tokenizers` library on the running Python's standard library
sources, `--vocab` ids (cached under out/bench_grammar/ after the first run, which takes about
a minute on two cores). Each engine gets the same vocabulary plus `--pad` padding ids (a model
vocabulary larger than the tokenizer's) and the same thread count (`--threads`).

Measured per engine:

* tokenizer: building the engine's view of the vocabulary (once per model).
* compile: one grammar of each kind (JSON schema, regex, choice, an EBNF grammar, JSON object
  mode), median over `--reps` compiles with no cache, and the time to the first mask (compile,
  matcher, first fill).
* mask: matchers walk valid outputs (random instances of each grammar, tokenized as a model
  would write them) token by token; filling the bitmask is timed at every token: batch 1 (one
  matcher, one pass over the outputs) and batch 64 (64 rows, each starting the next output
  when it finishes one, as a continuous batch does; all 64 rows filled per step: a Python
  loop over the rows, and the engine's parallel batch fill). Median / mean / p99 / max per
  fill; accepting the token is timed too.
* coverage: 37 JSON schemas, one feature each, with an instance that must pass and one that
  must fail. "enforced": compiles, accepts the valid instance, rejects the invalid one, and
  random walks (random allowed tokens until the grammar ends) produce only valid documents;
  "error": the engine refuses the schema (a clear error, which the engine turns into a
  ValueError); "IGNORED": it compiles but accepts the invalid instance (silently
  unconstrained); "loose": it rejects the invalid instance but a random walk wrote a document
  the validator (jsonschema_rs, formats checked) refuses, an edge of the feature left open;
  "over-strict": it rejects the valid instance.

Needs xgrammar, which jaxmamba does not depend on: `pip install --no-deps xgrammar
apache-tvm-ffi` (its declared requirements would pull torch, transformers and triton; it
imports torch, so torch must be there), and `jsonschema_rs` (the test extra's schemathesis
brings it).

    python scripts/bench_grammar.py [--vocab 65536] [--threads 2] [--reps 5] [--walks 3]
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

CACHE_DIR = Path(__file__).resolve().parent.parent / "out" / "bench_grammar"
EOS = "<|endoftext|>"

# ---------------------------------------------------------------------------------------------
# The tokenizer


def build_tokenizer(vocab_size: int) -> str:
    """A byte-level BPE of `vocab_size` ids (id 0 the EOS) as tokenizer.json text."""
    path = CACHE_DIR / f"tokenizer-{vocab_size}.json"
    if path.is_file():
        return path.read_text()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(f"{sys.base_prefix}/lib/python3*/**/*.py", recursive=True))
    if len(files) < 100:
        raise SystemExit(f"too little training text: {len(files)} files under {sys.base_prefix}")

    def texts():
        for f in files:
            try:
                yield Path(f).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    start = time.perf_counter()
    tok.train_from_iterator(texts(), trainer=trainer)
    print(
        f"# trained the tokenizer ({tok.get_vocab_size()} ids) in "
        f"{time.perf_counter() - start:.0f} s",
        file=sys.stderr,
    )
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(tok.to_str())
    return tok.to_str()


def token_bytes(tok) -> list[bytes]:
    """The bytes each id stands for (specials: b"")."""
    from jaxmamba.tokenizer import byte_level_chars

    decode = {c: b for b, c in enumerate(byte_level_chars())}
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    out = []
    for i in range(tok.get_vocab_size()):
        t = tok.id_to_token(i)
        out.append(b"" if t in special else bytes(decode[c] for c in t))
    return out


# ---------------------------------------------------------------------------------------------
# The engines, behind one small interface


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok_json: str, vocab_size: int, eos: int, threads: int):
        import xgrammar as xgr
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tok_json)
        start = time.perf_counter()
        vocab = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
        self.info = xgr.TokenizerInfo(
            vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[eos]
        )
        self.tokenizer_s = time.perf_counter() - start
        self.xgr = xgr
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, text: str):
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(text, any_whitespace=True)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=True)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            alts = " | ".join(json.dumps(s) for s in json.loads(text))
            return c.compile_grammar(f"root ::= {alts}")
        if kind == "grammar":
            return c.compile_grammar(text)
        raise ValueError(kind)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: np.ndarray, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok_json: str, vocab_size: int, eos: int, threads: int):
        import llguidance
        import llguidance.numpy

        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tok_json, n_vocab=vocab_size, eos_token=eos)
        self.tokenizer_s = time.perf_counter() - start
        self.llg, self.np = llguidance, llguidance.numpy
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, kind: str, text: str):
        """A pristine matcher: what the engine caches per grammar text (a request's matcher is a
        `deep_copy` of it)."""
        llg = self.llg
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(text)
        elif kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        else:
            grammar = llg.grammar_from(kind, text)
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask: np.ndarray, row: int) -> None:
        self.np.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: list, bitmask: np.ndarray) -> None:
        self.np.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


ENGINES = {"xgrammar": XGrammar, "llguidance": LLGuidance}

# ---------------------------------------------------------------------------------------------
# Grammars of each kind, with generators of valid outputs for the mask walks

WORDS = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
)
CITIES = ("Paris", "São Paulo", "New York", "Zürich", "Tokyo", "Lagos", "Reykjavík", "Perth")

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 60},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": r"^[a-z0-9.]+@[a-z0-9]+\.(com|org|net)$"},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": list(WORDS[:8])}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": r"^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "notes": {"type": "string"},
    },
    "required": ["name", "age", "email", "active", "score", "tags", "address", "notes"],
    "additionalProperties": False,
}

REGEX = r"[A-Z][a-z]{2,9} [0-9]{4}-[0-9]{2}-[0-9]{2} [a-z0-9._]{3,12}@[a-z]{3,8}\.(com|org|net)"

CHOICES = [f"{a} {b}" for a in WORDS[:6] for b in WORDS[6:10]]

EBNF = r"""root ::= expr
expr ::= term (ws [-+] ws term)*
term ::= factor (ws [*/] ws factor)*
factor ::= number | "(" ws expr ws ")" | "-" factor
number ::= [0-9]+ ("." [0-9]+)?
ws ::= " "?
"""


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS + CITIES) for _ in range(n)).capitalize() + "."


def person(rng: random.Random) -> str:
    doc = {
        "name": f"{rng.choice(WORDS).title()} {rng.choice(CITIES)}",
        "age": rng.randint(0, 150),
        "email": f"{rng.choice(WORDS)}.{rng.randint(1, 999)}@{rng.choice(WORDS)}.org",
        "active": rng.random() < 0.5,
        "score": round(rng.uniform(-1e3, 1e3), rng.randint(0, 4)),
        "tags": rng.sample(WORDS[:8], rng.randint(1, 4)),
        "address": {
            "street": f"{rng.randint(1, 999)} {_sentence(rng, 2)}",
            "city": rng.choice(CITIES),
            "zip": f"{rng.randint(0, 99999):05d}",
        },
        "notes": _sentence(rng, rng.randint(5, 25)),
    }
    return json.dumps(doc, ensure_ascii=False, indent=rng.choice([None, 2]))


def regex_instance(rng: random.Random) -> str:
    user = "".join(rng.choice("abcdefxyz0189._") for _ in range(rng.randint(3, 12)))
    return (
        f"{rng.choice(WORDS).title()} {rng.randint(1000, 9999)}-{rng.randint(1, 12):02d}-"
        f"{rng.randint(1, 28):02d} {user}@{rng.choice(WORDS)[:8].ljust(3, 'x')}."
        f"{rng.choice(['com', 'org', 'net'])}"
    )


def expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 3 or rng.random() < 0.3:
        n = str(rng.randint(0, 10 ** rng.randint(1, 5)))
        return n + (f".{rng.randint(0, 999)}" if rng.random() < 0.3 else "")
    if rng.random() < 0.2:
        return f"({expression(rng, depth + 1)})"
    sp = rng.choice(["", " "])
    return f"{expression(rng, depth + 1)}{sp}{rng.choice('+-*/')}{sp}{expression(rng, depth + 1)}"


def json_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice(
            [rng.randint(-999, 999), rng.random() * 100, _sentence(rng, 3), True, None]
        )
    if r < 0.6:
        return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(WORDS): json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}


def json_object(rng: random.Random) -> str:
    doc = {rng.choice(WORDS): json_value(rng, 1) for _ in range(rng.randint(2, 6))}
    return json.dumps(doc, ensure_ascii=False)


CASES = {  # name: (kind, grammar text, output generator)
    "json schema": ("json", json.dumps(PERSON_SCHEMA), person),
    "regex": ("regex", REGEX, regex_instance),
    "choice (24)": ("choice", json.dumps(CHOICES), lambda rng: rng.choice(CHOICES)),
    "EBNF grammar": ("grammar", EBNF, expression),
    "json_object": ("json_object", "", json_object),
}

# ---------------------------------------------------------------------------------------------
# Schema coverage: (feature, schema, an instance that must pass, one that must fail)

DEFS_SCHEMA = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
    "required": ["a", "b"],
}
TREE_SCHEMA = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3},
            },
            "required": ["value", "children"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
SHAPES = {
    "oneOf": [
        {
            "type": "object",
            "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
            "required": ["kind", "r"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "kind": {"const": "rect"},
                "w": {"type": "number"},
                "h": {"type": "number"},
            },
            "required": ["kind", "w", "h"],
            "additionalProperties": False,
        },
    ]
}


def _obj(props: dict, required=None, **kw) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        **kw,
    }


COVERAGE = [
    (
        "required properties",
        _obj({"s": {"type": "string"}, "i": {"type": "integer"}, "b": {"type": "boolean"}}),
        {"s": "x", "i": 3, "b": True},
        {"s": "x", "b": True},
    ),
    (
        "optional properties",
        _obj({"s": {"type": "string"}, "i": {"type": "integer"}}, ["s"]),
        {"s": "x"},
        {"s": "x", "i": "three"},
    ),
    (
        "nested objects (3 levels)",
        _obj({"a": _obj({"b": _obj({"c": {"type": "integer"}})})}),
        {"a": {"b": {"c": 1}}},
        {"a": {"b": {"c": "1"}}},
    ),
    (
        "array minItems/maxItems",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
        [1, 2, 3],
        [1, 2, 3, 4, 5],
    ),
    (
        "array of objects",
        {"type": "array", "items": _obj({"id": {"type": "integer"}})},
        [{"id": 1}, {"id": 2}],
        [{"id": 1}, {}],
    ),
    ("enum (strings)", {"enum": ["red", "green", "blue"]}, "green", "purple"),
    ("enum (mixed types)", {"enum": [1, "one", None, True, 2.5]}, None, 2),
    ("const", _obj({"v": {"const": "fixed"}}), {"v": "fixed"}, {"v": "other"}),
    ("anyOf", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 7, True),
    ("oneOf (tagged)", SHAPES, {"kind": "rect", "w": 1, "h": 2}, {"kind": "circle", "w": 1}),
    (
        "allOf",
        {"allOf": [_obj({"a": {"type": "integer"}}), _obj({"b": {"type": "string"}})]},
        {"a": 1, "b": "x"},
        {"a": 1},
    ),
    (
        "$ref / $defs",
        DEFS_SCHEMA,
        {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}},
        {"a": {"x": 1, "y": 2}, "b": {"x": 3}},
    ),
    (
        "recursive $ref",
        TREE_SCHEMA,
        {"value": 1, "children": [{"value": 2, "children": []}]},
        {"value": 1, "children": [{"value": "2", "children": []}]},
    ),
    ("pattern", {"type": "string", "pattern": r"^[A-Z]{3}-[0-9]{4}$"}, "ABC-1234", "AB-12345"),
    ("pattern (unanchored)", {"type": "string", "pattern": "[0-9]{3}"}, "ab123cd", "ab12cd"),
    (
        "format date-time",
        {"type": "string", "format": "date-time"},
        "2026-12-03T10:20:30Z",
        "yesterday",
    ),
    ("format date", {"type": "string", "format": "date"}, "2026-12-03", "03/12/2026"),
    ("format time", {"type": "string", "format": "time"}, "10:20:30Z", "ten past ten"),
    ("format email", {"type": "string", "format": "email"}, "ann@example.com", "not an email"),
    (
        "format uuid",
        {"type": "string", "format": "uuid"},
        "123e4567-e89b-12d3-a456-426614174000",
        "123e4567",
    ),
    ("format ipv4", {"type": "string", "format": "ipv4"}, "192.168.0.1", "999.1.1.1"),
    (
        "format uri",
        {"type": "string", "format": "uri"},
        "https://example.com/a?b=c",
        "no scheme here",
    ),
    (
        "additionalProperties false",
        _obj({"a": {"type": "integer"}}, additionalProperties=False),
        {"a": 1},
        {"a": 1, "z": 2},
    ),
    (
        "additionalProperties schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"k": 1, "m": 2},
        {"k": "v"},
    ),
    ("integer minimum/maximum", {"type": "integer", "minimum": -5, "maximum": 120}, 42, 121),
    (
        "number exclusive bounds",
        {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        0.5,
        1,
    ),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 35, 36),
    (
        "string minLength/maxLength",
        {"type": "string", "minLength": 2, "maxLength": 5},
        "abc",
        "abcdefg",
    ),
    ("type list (nullable)", _obj({"v": {"type": ["string", "null"]}}), {"v": None}, {"v": 1}),
    (
        "prefixItems (tuple)",
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
        ["a", 1],
        [1, "a"],
    ),
    (
        "uniqueItems",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        [1, 2],
        [1, 1],
    ),
    (
        "minProperties/maxProperties",
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "minProperties": 1,
            "maxProperties": 2,
        },
        {"a": 1},
        {},
    ),
    (
        "patternProperties",
        {
            "type": "object",
            "patternProperties": {"^x_[a-z]+$": {"type": "integer"}},
            "additionalProperties": False,
        },
        {"x_a": 1},
        {"y": 1},
    ),
    (
        "if/then/else",
        {
            "type": "object",
            "if": _obj({"t": {"const": "a"}}),
            "then": _obj({"n": {"type": "integer"}}, ["t", "n"]),
            "else": _obj({"s": {"type": "string"}}, ["t", "s"]),
        },
        {"t": "a", "n": 1},
        {"t": "a", "s": "x"},
    ),
    ("not", {"type": "integer", "not": {"const": 3}}, 4, 3),
    ("contains", {"type": "array", "contains": {"const": 7}}, [1, 7], [1, 2]),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        {"a": 1, "b": 2},
        {"a": 1},
    ),
]

# ---------------------------------------------------------------------------------------------
# Walking a matcher


class Vocab:
    def __init__(self, tok_json: str, vocab_size: int):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(tok_json)
        self.eos = self.tok.token_to_id(EOS)
        self.size = vocab_size
        self.bytes = token_bytes(self.tok)
        self.words = (vocab_size + 31) // 32
        # tokens that close strings, containers and numbers: random walks pick them often so
        # that they end
        self.closers = np.array(
            [i for i, b in enumerate(self.bytes) if b and set(b) <= set(b'"]})') and len(b) <= 3]
        )
        self.short = np.array([i for i, b in enumerate(self.bytes) if len(b) == 1])

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def allowed(self, row: np.ndarray) -> np.ndarray:
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: self.size]
        return np.flatnonzero(bits)

    def text(self, ids: list[int]) -> str:
        return b"".join(self.bytes[i] for i in ids if i < len(self.bytes)).decode("utf-8")


def accepts_text(engine, compiled, vocab: Vocab, text: str) -> bool:
    """Whether the grammar accepts `text` (tokenized as a model writes it) and then EOS."""
    m = engine.matcher(compiled)
    bitmask = np.zeros((1, vocab.words), np.int32)
    for t in vocab.encode(text):
        engine.fill(m, bitmask, 0)
        if not (bitmask[0, t // 32] >> (t % 32)) & 1 or not engine.accept(m, t):
            return False
    engine.fill(m, bitmask, 0)
    return bool((bitmask[0, vocab.eos // 32] >> (vocab.eos % 32)) & 1)


def random_walk(engine, compiled, vocab: Vocab, rng: np.random.Generator, budget: int):
    """Random allowed tokens until the grammar ends: the text, or None if the budget ran out.
    Raises if a token the mask allowed is refused, or if no token is allowed."""
    m = engine.matcher(compiled)
    bitmask = np.zeros((1, vocab.words), np.int32)
    ids = []
    for _ in range(budget):
        engine.fill(m, bitmask, 0)
        allowed = vocab.allowed(bitmask[0])
        if len(allowed) == 0:
            raise AssertionError(f"no token allowed after {vocab.text(ids)!r}")
        if vocab.eos in allowed and rng.random() < 0.5:
            return vocab.text(ids)
        r = rng.random()
        pool = allowed
        if r < 0.35:
            pool = np.intersect1d(allowed, vocab.closers, assume_unique=True)
        elif r < 0.7:
            pool = np.intersect1d(allowed, vocab.short, assume_unique=True)
        t = int(rng.choice(pool if len(pool) else allowed))
        if not engine.accept(m, t):
            raise AssertionError(f"allowed token {t} refused after {vocab.text(ids)!r}")
        if t == vocab.eos:
            return vocab.text(ids)
        ids.append(t)
    return None


# ---------------------------------------------------------------------------------------------
# Measurements


def time_compile(engine, kind: str, text: str, vocab: Vocab, reps: int) -> tuple[float, float]:
    """(median compile seconds, median seconds to the first mask)."""
    compiles, firsts = [], []
    bitmask = np.zeros((1, vocab.words), np.int32)
    for _ in range(reps):
        start = time.perf_counter()
        compiled = engine.compile(kind, text)
        compiled_at = time.perf_counter()
        engine.fill(engine.matcher(compiled), bitmask, 0)
        done = time.perf_counter()
        compiles.append(compiled_at - start)
        firsts.append(done - start)
    return statistics.median(compiles), statistics.median(firsts)


def time_masks(
    engine,
    compiled,
    outputs: list[list[int]],
    vocab: Vocab,
    batch: int,
    parallel: bool,
    steps: int,
) -> dict:
    """`batch` rows walk `outputs` (token ids) as a continuous batch does: a row that finishes
    its output starts the next one (a fresh matcher), cycling through the outputs. Every fill
    of the batch's rows (the engine's parallel batch fill, or a loop over the rows) is timed,
    and every accept; `steps` fills in all (batch 1: one pass over the outputs)."""
    fills, accepts, tokens = [], [], 0
    bitmask = np.zeros((batch, vocab.words), np.int32)
    queue = itertools.cycle(outputs)
    rows = [[engine.matcher(compiled), next(queue), 0] for _ in range(batch)]
    if batch == 1:
        steps = sum(len(ids) for ids in outputs)
    for _ in range(steps):
        start = time.perf_counter()
        if parallel:
            engine.fill_batch([m for m, _, _ in rows], bitmask)
        else:
            for i, (m, _, _) in enumerate(rows):
                engine.fill(m, bitmask, i)
        fills.append(time.perf_counter() - start)
        for i, row in enumerate(rows):
            m, ids, pos = row
            t = ids[pos]
            if not (bitmask[i, t // 32] >> (t % 32)) & 1:
                raise AssertionError(f"{engine.name}: valid token {t} masked at {pos}")
            start = time.perf_counter()
            ok = engine.accept(m, t)
            accepts.append(time.perf_counter() - start)
            if not ok:
                raise AssertionError(f"{engine.name}: valid token {t} refused")
            tokens += 1
            row[2] += 1
            if row[2] == len(ids):
                row[:] = [engine.matcher(compiled), next(queue), 0]
    us = 1e6 * np.array(fills)
    return {
        "steps": len(fills),
        "tokens": tokens,
        "fill_p50_us": float(np.median(us)),
        "fill_mean_us": float(us.mean()),
        "fill_p99_us": float(np.percentile(us, 99)),
        "fill_max_us": float(us.max()),
        "accept_mean_us": 1e6 * float(np.mean(accepts)),
    }


def coverage(engine, vocab: Vocab, walks: int, budget: int, seed: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    out = []
    for feature, schema, good, bad in COVERAGE:
        try:
            compiled = engine.compile("json", json.dumps(schema))
        except Exception as e:  # each engine raises its own type
            out.append((feature, "error: " + str(e).strip().splitlines()[-1][:70]))
            continue
        if not accepts_text(engine, compiled, vocab, json.dumps(good)):
            out.append((feature, "over-strict"))
            continue
        if accepts_text(engine, compiled, vocab, json.dumps(bad)):
            out.append((feature, "IGNORED (invalid instance accepted)"))
            continue
        status = "enforced"
        unfinished = 0
        for _ in range(walks):
            text = random_walk(engine, compiled, vocab, rng, budget)
            ok = None if text is None else valid(schema, text)
            if ok is None:
                unfinished += 1
            elif not ok:
                status = f"loose (walk wrote {text[:30]!r})"
                break
        if status == "enforced" and unfinished:
            status += f" ({unfinished}/{walks} walks unfinished or unjudged)"
        out.append((feature, status))
    return out


def valid(schema: dict, text: str) -> bool | None:
    """Whether `text` is a document `schema` accepts; None if a number in it is beyond a
    float's range (1e999: valid JSON that the validator cannot judge)."""
    import jsonschema_rs

    def parse_float(s: str) -> float:
        f = float(s)
        if math.isinf(f) or (f == 0 and any(c in "123456789" for c in s.lower().split("e")[0])):
            raise OverflowError(s)
        return f

    try:
        doc = json.loads(text, parse_float=parse_float)
    except OverflowError:
        return None
    except ValueError:
        return False
    return jsonschema_rs.validator_for(schema, validate_formats=True).is_valid(doc)


def check_coverage_cases() -> None:
    for feature, schema, good, bad in COVERAGE:
        if (
            valid(schema, json.dumps(good)) is not True
            or valid(schema, json.dumps(bad)) is not False
        ):
            raise AssertionError(f"coverage case {feature!r}: its instances are wrong")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=65536, help="tokenizer ids")
    p.add_argument("--pad", type=int, default=64, help="model ids past the tokenizer's")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="compiles timed per grammar")
    p.add_argument("--outputs", type=int, default=128, help="valid outputs walked per grammar")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=300, help="fills timed per batch > 1")
    p.add_argument("--walks", type=int, default=3, help="random walks per coverage schema")
    p.add_argument("--budget", type=int, default=400, help="tokens per random walk")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every figure to this file")
    args = p.parse_args()

    check_coverage_cases()
    tok_json = build_tokenizer(args.vocab)
    vocab = Vocab(tok_json, args.vocab + args.pad)
    rng = random.Random(args.seed)
    outputs = {
        name: [vocab.encode(gen(rng)) for _ in range(args.outputs)]
        for name, (_, _, gen) in CASES.items()
    }
    print(
        f"# tokenizer: byte-level BPE, {args.vocab} ids (+{args.pad} padding), "
        f"threads {args.threads}"
    )
    for name, outs in outputs.items():
        lens = [len(o) for o in outs]
        print(f"# {name}: {len(outs)} outputs, {min(lens)}-{max(lens)} tokens")

    results = {}
    for ename in args.engines:
        engine = ENGINES[ename](tok_json, vocab.size, vocab.eos, args.threads)
        r = results[ename] = {"tokenizer_s": engine.tokenizer_s, "compile": {}, "mask": {}}
        for name, (kind, text, _) in CASES.items():
            r["compile"][name] = time_compile(engine, kind, text, vocab, args.reps)
            compiled = engine.compile(kind, text)
            for b in args.batch:
                for parallel in (False, True) if b > 1 else (False,):
                    key = f"{name} b{b}" + (" parallel" if parallel else "")
                    r["mask"][key] = time_masks(
                        engine, compiled, outputs[name], vocab, b, parallel, args.steps
                    )
        r["coverage"] = coverage(engine, vocab, args.walks, args.budget, args.seed)

    names = args.engines
    print(
        f"\n## Tokenizer info (once per model)\n\n| | {' | '.join(names)} |\n|---|"
        + "---|" * len(names)
    )
    print(
        "| build | " + " | ".join(f"{results[n]['tokenizer_s'] * 1e3:.0f} ms" for n in names) + " |"
    )
    print(f"\n## Compile (median of {args.reps}, no cache): compile / to first mask, ms\n")
    print(f"| grammar | {' | '.join(names)} |\n|---|" + "---|" * len(names))
    for case in CASES:
        cells = [
            f"{results[n]['compile'][case][0] * 1e3:.2f} / "
            f"{results[n]['compile'][case][1] * 1e3:.2f}"
            for n in names
        ]
        print(f"| {case} | {' | '.join(cells)} |")
    print("\n## Mask fill per step, µs: median / mean / p99 / max (accept mean)\n")
    print(f"| grammar, batch | {' | '.join(names)} |\n|---|" + "---|" * len(names))
    for key in results[names[0]]["mask"]:
        cells = []
        for n in names:
            m = results[n]["mask"][key]
            cells.append(
                f"{m['fill_p50_us']:.0f} / {m['fill_mean_us']:.0f} / {m['fill_p99_us']:.0f} / "
                f"{m['fill_max_us']:.0f} ({m['accept_mean_us']:.0f})"
            )
        steps = results[names[0]]["mask"][key]["steps"]
        print(f"| {key} ({steps} steps) | {' | '.join(cells)} |")
    print("\n## JSON schema coverage\n")
    print(f"| feature | {' | '.join(names)} |\n|---|" + "---|" * len(names))
    for i, (feature, *_) in enumerate(COVERAGE):
        print(f"| {feature} | " + " | ".join(results[n]["coverage"][i][1] for n in names) + " |")
    summary = []
    for n in names:
        statuses = [s.split(" ")[0].rstrip(":") for _, s in results[n]["coverage"]]
        count = {k: statuses.count(k) for k in ("enforced", "loose", "error")}
        wrong = len(statuses) - sum(count.values())
        summary.append(
            f"{count['enforced']} enforced, {count['loose']} loose, "
            f"{count['error']} refused, {wrong} wrong"
        )
    print(f"| **total ({len(COVERAGE)})** | " + " | ".join(summary) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
