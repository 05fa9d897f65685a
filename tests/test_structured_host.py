"""Structured outputs on the host (`jaxmamba.structured`): random "model" walks that sample
random allowed tokens from each bitmask until the grammar ends, checked against independent
references (a JSON-schema validator, `re.fullmatch`, the choice list, Python's parser); bad
constraints; the compile cache; padding ids, stop ids, rollback and the bitmask layout."""

import ast
import json
import random
import re
import threading

import numpy as np
import pytest

from jaxmamba.structured import (
    GrammarCompiler,
    GrammarMatcher,
    StructuredOutputsParams,
    apply_bitmask_ref,
    bitmask_words,
    fill_bitmasks,
    unpack_bitmask,
    validate,
)
from jaxmamba.tokenizer import ByteTokenizer

from schema_helpers import FORMATS, assert_valid

EOS, PAD = "<|endoftext|>", "<|pad|>"
# ids past the tokenizer's: a model vocabulary padded, not to a multiple of 32
EXTRA_IDS = 45
WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "zeta", "theta", "lambda", "sigma"]


def _byte_chars() -> dict[str, int]:
    """GPT-2's byte-level map, character -> byte (what the ByteLevel pre-tokenizer writes)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _corpus(rng: random.Random) -> list[str]:
    def value(depth):
        r = rng.random()
        if depth > 2 or r < 0.4:
            return rng.choice([rng.randint(-10**6, 10**6), round(rng.uniform(-1e3, 1e3), 3),
                               " ".join(rng.choices(WORDS, k=3)), True, False, None])  # fmt: skip
        if r < 0.7:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice(WORDS): value(depth + 1) for _ in range(rng.randint(1, 4))}

    docs = [json.dumps(value(0), indent=rng.choice([None, 2])) for _ in range(3000)]
    prose = [" ".join(rng.choices(WORDS + ["the", "a", "of", "ünï", "✓", "数"], k=12))
             for _ in range(1000)]  # fmt: skip
    return docs + prose


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE (GPT-2's pre-tokenizer, like Qwen's and Nemotron's) of ~4k ids trained
    on random JSON and prose; id 0 is the eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4000,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(0)), trainer=trainer)
    assert tok.get_vocab_size() > 3000 and tok.token_to_id(EOS) == 0
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, tokenizer.get_vocab_size() + EXTRA_IDS, eos_ids=[0])
    yield c
    c.close()


@pytest.fixture(scope="module")
def token_bytes(tokenizer):
    chars = _byte_chars()
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    out = []
    for i in range(tokenizer.get_vocab_size()):
        t = tokenizer.id_to_token(i)
        out.append(b"" if t in special else bytes(chars[c] for c in t))
    return out


class Walker:
    """A random "model": samples allowed tokens (often short ones and ones that close strings
    and containers, so that walks end) and checks every mask on the way."""

    def __init__(self, compiler, token_bytes, seed):
        self.compiler, self.bytes = compiler, token_bytes
        self.vocab = compiler.vocab
        self.rng = np.random.default_rng(seed)
        self.closers = np.array(
            [i for i, b in enumerate(token_bytes) if b and set(b) <= set(b'"]})') and len(b) <= 3]
        )
        self.short = np.array([i for i, b in enumerate(token_bytes) if len(b) == 1])

    def walk(self, params, budget=300, stop_ids=()):
        """The text written until the grammar ended (None if the budget ran out) and the token
        ids (the stop token last)."""
        m = GrammarMatcher(self.compiler.compile(params), stop_ids)
        bitmask = np.zeros((3, self.vocab.words), np.int32)
        ids = []
        for _ in range(budget):
            m.fill_bitmask(bitmask, 1)
            allowed = unpack_bitmask(bitmask[1], self.vocab.vocab_size)
            assert not allowed[self.vocab.tokenizer_size :].any(), "a padding id is allowed"
            allowed = np.flatnonzero(allowed)
            assert allowed.size, f"no token allowed after {self._text(ids)!r}"
            stops = np.intersect1d(allowed, m.stop_ids)
            if stops.size and self.rng.random() < 0.5:
                t = int(self.rng.choice(stops))
            else:
                r, pool = self.rng.random(), allowed
                if r < 0.35:
                    pool = np.intersect1d(allowed, self.closers)
                elif r < 0.7:
                    pool = np.intersect1d(allowed, self.short)
                t = int(self.rng.choice(pool if pool.size else allowed))
            assert m.accept_token(t), f"allowed token {t} refused after {self._text(ids)!r}"
            ids.append(t)
            if m.is_terminated():
                assert t in m.stop_ids
                return self._text(ids[:-1]), ids
        return None, ids

    def _text(self, ids) -> str:
        return b"".join(self.bytes[i] for i in ids).decode("utf-8")

    def finished_walks(self, params, count, budget=300):
        texts = [self.walk(params, budget)[0] for _ in range(count)]
        done = [t for t in texts if t is not None]
        assert len(done) >= count // 2, f"{count - len(done)} of {count} walks did not end"
        return done


def random_schema(rng: random.Random, defs: dict, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "pattern", "format"]
    if depth < 3:
        kinds += ["object", "object", "array", "anyOf", "ref"]
    kind = rng.choice(kinds)
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 12)}
    if kind in ("integer", "number"):
        lo = rng.randint(-1000, 1000)
        return {"type": kind, "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample([*WORDS, 7, -3, 2.5, None, True, 'a"b', "ü✓"], 4)}
    if kind == "pattern":
        pattern = rng.choice([r"^[a-z]{2,6}$", r"^\d{3}-\d{2,4}$", r"^(foo|bar)_[A-Z]+$",
                              r"^[A-F0-9]{4}( [A-F0-9]{4})?$"])  # fmt: skip
        return {"type": "string", "pattern": pattern}
    if kind == "format":
        return {"type": "string", "format": rng.choice(sorted(FORMATS))}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, defs, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 3)}  # fmt: skip
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, defs, depth + 1) for _ in range(2)]}
    if kind == "ref":
        target = random_schema(rng, defs, depth + 1)  # may add defs of its own first
        name = f"d{len(defs)}"
        defs[name] = target
        return {"$ref": f"#/$defs/{name}"}
    names = rng.sample(WORDS, rng.randint(1, 4))
    props = {n: random_schema(rng, defs, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    out = {"type": "object", "properties": props, "required": required}
    if rng.random() < 0.6:
        out["additionalProperties"] = False
    return out


def random_root_schema(seed: int) -> dict:
    rng = random.Random(seed)
    defs = {}
    schema = random_schema(rng, defs)
    while schema.get("type") != "object":
        schema = random_schema(rng, defs)
    schema["additionalProperties"] = False  # a closed top level, or walks wander off in keys
    return {**schema, "$defs": defs} if defs else schema


# ---------------------------------------------------------------------------------------------
# Walks against references


@pytest.mark.parametrize("seed", range(12))
def test_random_walks_satisfy_random_json_schemas(compiler, token_bytes, seed):
    schema = random_root_schema(seed)
    walker = Walker(compiler, token_bytes, seed)
    for text in walker.finished_walks(StructuredOutputsParams(json=schema), 6, budget=400):
        assert_valid(text, schema)


def _with_additional_properties(schema, value):
    """`schema` with every object's additionalProperties removed (value None) or set."""
    if isinstance(schema, list):
        return [_with_additional_properties(s, value) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _with_additional_properties(v, value) for k, v in schema.items()
           if k != "additionalProperties"}  # fmt: skip
    if value is not None and schema.get("type") == "object":
        out["additionalProperties"] = value
    return out


def _whitespace_outside_strings(text: str) -> bool:
    in_string = escaped = False
    for ch in text:
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            return True
    return False


def test_random_walks_respect_disable_options(compiler, token_bytes):
    schema = random_root_schema(100)
    params = StructuredOutputsParams(
        json=_with_additional_properties(schema, None),
        disable_any_whitespace=True,
        disable_additional_properties=True,
    )
    closed = _with_additional_properties(schema, False)
    for text in Walker(compiler, token_bytes, 1).finished_walks(params, 6, budget=400):
        assert not _whitespace_outside_strings(text), text
        assert_valid(text, closed)


def _random_regex(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(2, 5)):
        kind = rng.randrange(5)
        if kind == 0:
            parts.append(re.escape(rng.choice(WORDS + ["-", "@", ".", " ", "ü"])))
        elif kind == 1:
            lo = rng.randint(0, 3)
            parts.append(
                f"[{rng.choice(['a-z', 'A-Z0-9', 'xyz_.'])}]{{{lo},{lo + rng.randint(1, 4)}}}"
            )
        elif kind == 2:
            # [0-9], not \d: Rust's \d knows newer Unicode digits than this Python's re
            parts.append(f"[0-9]{{{rng.randint(1, 4)}}}")
        elif kind == 3:
            parts.append("(" + "|".join(rng.sample(WORDS, 3)) + ")")
        else:
            parts.append(f"({re.escape(rng.choice(WORDS))}[0-9]?)?")
    return "".join(parts)


@pytest.mark.parametrize("seed", range(8))
def test_random_walks_match_random_regexes(compiler, token_bytes, seed):
    pattern = _random_regex(random.Random(seed))
    for text in Walker(compiler, token_bytes, seed).finished_walks(
        StructuredOutputsParams(regex=pattern), 8
    ):
        assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("seed", range(4))
def test_random_walks_pick_one_of_the_choices(compiler, token_bytes, seed):
    rng = random.Random(seed)
    base = ["".join(rng.choices('ab"\\ üz✓\n{}', k=rng.randint(1, 8))) for _ in range(6)]
    choices = base + [base[0] + "tail", rng.choice(WORDS)]  # one choice a prefix of another
    texts = Walker(compiler, token_bytes, seed).finished_walks(
        StructuredOutputsParams(choice=choices), 12
    )
    assert set(texts) <= set(choices)


ARITHMETIC_GBNF = r"""root ::= expr
expr ::= term (ws [-+] ws term)*
term ::= factor (ws [*/] ws factor)*
factor ::= number | "(" ws expr ws ")" | "-" factor
number ::= ("0" | [1-9] [0-9]*) ("." [0-9]+)?
ws ::= " "?
"""
ARITHMETIC_LARK = r"""start: expr
expr: term (WS? /[-+]/ WS? term)*
term: factor (WS? /[*\/]/ WS? factor)*
factor: NUMBER | "(" WS? expr WS? ")" | "-" factor
NUMBER: /(0|[1-9][0-9]*)(\.[0-9]+)?/
WS: " "
"""


@pytest.mark.parametrize("grammar", [ARITHMETIC_GBNF, ARITHMETIC_LARK], ids=["gbnf", "lark"])
def test_random_walks_parse_as_python_expressions(compiler, token_bytes, grammar):
    texts = Walker(compiler, token_bytes, 3).finished_walks(
        StructuredOutputsParams(grammar=grammar), 12
    )
    for text in texts:
        tree = ast.parse(text, mode="eval")
        names = {type(n).__name__ for n in ast.walk(tree)}
        assert names <= {"Expression", "BinOp", "UnaryOp", "Constant", "Add", "Sub", "Mult",
                         "Div", "USub"}, text  # fmt: skip


def test_json_object_mode_writes_objects(compiler, token_bytes):
    texts = Walker(compiler, token_bytes, 5).finished_walks(
        StructuredOutputsParams(json_object=True), 10, budget=400
    )
    assert all(isinstance(json.loads(t), dict) for t in texts)


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({}, ["exactly one", "none"]),
        ({"json": {}, "regex": "a"}, ["exactly one", "json, regex"]),
        ({"json_object": False}, ["json_object", "True"]),
        ({"json": "{not json"}, ["not valid JSON"]),
        ({"choice": []}, ["at least one"]),
        ({"regex": ""}, ["regex", "non-empty"]),
        ({"structural_tag": "{}"}, ["structural_tag", "not supported"]),
        ({"json_object": True, "disable_any_whitespace": True, "whitespace_pattern": " "},
         ["whitespace_pattern"]),
    ],
)  # fmt: skip
def test_bad_params_raise_value_error_naming_the_problem(kwargs, words):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(
    "kwargs",
    [{"json": 3}, {"regex": 5}, {"choice": "ab"}, {"choice": ["a", 2]}, {"grammar": b"x"},
     {"json_object": True, "disable_any_whitespace": 1}],
)  # fmt: skip
def test_wrongly_typed_params_raise_type_error(kwargs):
    with pytest.raises(TypeError):
        StructuredOutputsParams(**kwargs)


BAD_CONSTRAINTS = [
    ({"json": {"type": "objekt"}}, "objekt"),
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
     "uniqueItems"),
    ({"json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}, "not"),
    ({"json": {"type": "string", "format": "credit-card"}}, "credit-card"),
    ({"json": {"$ref": "#/$defs/missing"}}, "missing"),
    ({"json": {"type": "string", "pattern": "(?=a)a"}}, "look-around"),
    ({"regex": "[a-"}, "unclosed character class"),
    ({"regex": r"(a)\1"}, "backreferences"),
    ({"grammar": 'root ::= "a" | undefined_rule'}, "undefined_rule"),
    ({"grammar": 'start: "a" | b'}, "unknown name"),
]  # fmt: skip
UNSATISFIABLE = [
    ({"json": {"type": "integer", "minimum": 5, "maximum": 2}}, "minimum"),
    ({"json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "incompatible types"),
    ({"json": False}, "false"),
]


@pytest.mark.parametrize("kwargs, word", BAD_CONSTRAINTS + UNSATISFIABLE)
def test_bad_constraints_raise_value_error_naming_the_problem(compiler, kwargs, word):
    params = StructuredOutputsParams(**kwargs)
    kind = next(iter(kwargs))
    if (kwargs, word) in BAD_CONSTRAINTS:  # caught without a tokenizer, before compiling
        with pytest.raises(ValueError, match=re.escape(word)) as e:
            validate(params)
        assert f"structured_outputs.{kind}" in str(e.value)
    with pytest.raises(ValueError, match=re.escape(word)):
        compiler.compile(params)
    with pytest.raises(ValueError, match=re.escape(word)):
        compiler.submit(params).result(timeout=30)


def test_unsupported_tokenizer_raises_value_error():
    """A SentencePiece-style tokenizer with a bare Metaspace decoder: llguidance cannot tell
    its token bytes, so no request can be constrained (and none is left unconstrained)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(WORDS * 5, trainer=trainer)
    c = GrammarCompiler(tok, 64, eos_ids=[1])
    with pytest.raises(ValueError, match="cannot use this tokenizer"):
        c.compile(StructuredOutputsParams(regex="a+"))
    c.close()


# ---------------------------------------------------------------------------------------------
# The cache


def test_cache_compiles_each_grammar_text_once(tokenizer):
    c = GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), eos_ids=[0], max_cached=5)
    schemas = [random_root_schema(200 + i) for i in range(3)]
    params = [StructuredOutputsParams(json=s) for s in schemas]
    params += [StructuredOutputsParams(json=json.dumps(s)) for s in schemas]  # same keys
    params += [StructuredOutputsParams(regex=r"[a-z]+\d"), StructuredOutputsParams(regex="x")]
    got = []

    def worker(i):
        rng = random.Random(i)
        for p in rng.choices(params, k=20):
            got.append((p.key, (c.submit(p).result() if rng.random() < 0.5 else c.compile(p))))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 80
    assert c.num_compiles == 5  # 3 schemas (dict or text) + 2 regexes, each once
    assert all(compiled is c.compile(p) for key, compiled in got for p in params if p.key == key)
    # Least recently used out first: a sixth grammar evicts the oldest of the five.
    for p in params[:3] + params[6:]:
        c.compile(p)  # the order of use: schemas 0-2, then the regexes
    c.compile(StructuredOutputsParams(choice=["yes", "no"]))
    assert c.num_compiles == 6 and not c.cached(params[0]) and c.cached(params[1])
    c.compile(params[0])
    assert c.num_compiles == 7
    c.close()


def test_options_are_part_of_the_key():
    base = StructuredOutputsParams(json={"type": "object"})
    assert base.key == StructuredOutputsParams(json='{"type": "object"}').key
    others = [
        StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True),
        StructuredOutputsParams(json={"type": "object"}, disable_additional_properties=True),
        StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=" ?"),
        StructuredOutputsParams(json_object=True),
    ]
    assert len({base.key, *(p.key for p in others)}) == 5
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        label: str | None = None

    model = StructuredOutputsParams(json=Point)
    assert model.key == StructuredOutputsParams(json=Point.model_json_schema()).key


# ---------------------------------------------------------------------------------------------
# Stop tokens, padding, rollback, the bitmask


def test_stop_ids_are_allowed_only_where_the_grammar_ends(compiler, tokenizer):
    # A request stop id that is also ordinary text the grammar allows: masked mid-grammar.
    digit = tokenizer.token_to_id("7")
    m = GrammarMatcher(
        compiler.compile(StructuredOutputsParams(regex=r"[0-9]{3}")), stop_ids=[digit]
    )
    bitmask = np.zeros((1, compiler.vocab.words), np.int32)
    for t in tokenizer.encode("12").ids:
        m.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask[0], compiler.vocab.vocab_size)
        assert not allowed[digit] and not allowed[0]
        assert not m.accept_token(digit) and not m.accept_token(0)
        assert m.accept_token(t)
    assert not m.must_stop()
    assert m.accept_token(tokenizer.token_to_id("5"))
    assert m.must_stop()
    m.fill_bitmask(bitmask, 0)  # "125": complete, nothing may follow but a stop
    assert set(np.flatnonzero(unpack_bitmask(bitmask[0], compiler.vocab.vocab_size))) == {0, digit}
    assert m.accept_token(digit) and m.is_terminated()
    assert not m.accept_token(0)
    m.fill_bitmask(bitmask, 0)
    assert set(np.flatnonzero(unpack_bitmask(bitmask[0], compiler.vocab.vocab_size))) == {0, digit}


def test_a_grammar_that_fails_midway_allows_nothing_and_says_why(compiler, tokenizer):
    """A schema whose $ref is itself passes validation; llguidance finds the dead end at the
    property's value, and would then allow only eos (ending the document there)."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
              "$defs": {"x": {"$ref": "#/$defs/x"}}}  # fmt: skip
    m = GrammarMatcher(compiler.compile(StructuredOutputsParams(json=schema)))
    bitmask = np.full((2, compiler.vocab.words), -1, np.int32)
    for t in tokenizer.encode('{"a": 1}').ids:
        m.fill_bitmask(bitmask, 0)
        if m.error is not None:
            break
        assert m.accept_token(t)
    assert m.error and "cannot go on" in m.error, m.error
    assert not bitmask[0].any()
    assert not m.accept_token(0) and not m.must_stop()
    np.testing.assert_array_equal(bitmask[1], -1)


def test_rollback_restores_earlier_masks(compiler, token_bytes):
    rng = random.Random(7)
    for params in [StructuredOutputsParams(json=random_root_schema(7)),
                   StructuredOutputsParams(regex=r"[a-c]{2}(x|yz)"),  # stops by itself
                   StructuredOutputsParams(regex=r"[a-c]+")]:  # fmt: skip
        _, ids = Walker(compiler, token_bytes, 9).walk(params, budget=400)
        m = GrammarMatcher(compiler.compile(params))
        masks = np.zeros((len(ids) + 1, compiler.vocab.words), np.int32)
        for i, t in enumerate(ids):
            m.fill_bitmask(masks, i)
            assert m.accept_token(t)
        m.fill_bitmask(masks, len(ids))
        for _ in range(4):
            back = rng.randint(0, m.num_tokens)
            m.rollback(back)
            again = np.zeros((1, compiler.vocab.words), np.int32)
            m.fill_bitmask(again, 0)
            np.testing.assert_array_equal(again[0], masks[m.num_tokens])
            for t in ids[m.num_tokens :]:  # and forward again
                assert m.accept_token(t)
        assert m.is_terminated() == (ids[-1] in m.stop_ids) == m.must_stop()
        with pytest.raises(ValueError):
            m.rollback(m.num_tokens + 1)


def test_validate_tokens_counts_the_valid_prefix(compiler, token_bytes):
    params = StructuredOutputsParams(json=random_root_schema(3))
    rng = random.Random(0)
    for seed in range(4):
        text, ids = Walker(compiler, token_bytes, seed).walk(params, budget=400)
        if text is None:
            continue
        m = GrammarMatcher(compiler.compile(params))
        assert m.validate_tokens(ids) == len(ids)
        last_close = max(i for i, t in enumerate(ids) if b"}" in token_bytes[t])
        cut = rng.randrange(last_close)  # the document is not complete before its last "}"
        bad = ids[:cut] + [compiler.vocab.eos_ids[0]] + ids[cut:]  # a stop mid-document
        assert m.validate_tokens(bad) == cut
        assert m.num_tokens == 0 and m.validate_tokens(ids) == len(ids)  # nothing changed


def test_padding_ids_are_never_allowed(compiler):
    v = compiler.vocab
    assert v.vocab_size == v.tokenizer_size + EXTRA_IDS and v.vocab_size % 32
    # Inside a free string almost every token is allowed: the padding ids must still not be.
    m = GrammarMatcher(compiler.compile(StructuredOutputsParams(json={"type": "string"})))
    bitmask = np.full((2, v.words), -1, np.int32)
    assert m.accept_token(compiler.vocab.tokenizer.tokenize_str('"')[0])  # in the string
    m.fill_bitmask(bitmask, 1)
    allowed = unpack_bitmask(bitmask[1], v.vocab_size)
    assert allowed[: v.tokenizer_size].sum() > v.tokenizer_size // 2
    assert not allowed[v.tokenizer_size :].any()
    tail_bits = v.words * 32 - v.vocab_size  # past the vocabulary, in the last word
    assert (bitmask[1, -1].view(np.uint32) >> np.uint32(32 - tail_bits)) == 0
    np.testing.assert_array_equal(bitmask[0], -1)  # other rows untouched


def test_parallel_fill_matches_the_row_loop(compiler, token_bytes):
    import llguidance

    params = [StructuredOutputsParams(json=random_root_schema(s)) for s in range(3)]
    params += [StructuredOutputsParams(regex=r"[a-z]{1,3}")]
    matchers, rng = [], random.Random(1)
    for i in range(16):
        p = params[i % len(params)]
        _, ids = Walker(compiler, token_bytes, 50 + i).walk(p, budget=400)
        m = GrammarMatcher(compiler.compile(p))
        for t in ids[: rng.randint(0, len(ids))]:  # terminated ones too
            assert m.accept_token(t)
        matchers.append(m)
    rows = rng.sample(range(20), 16)
    loop = np.zeros((20, compiler.vocab.words), np.int32)
    par = np.zeros_like(loop)
    fill_bitmasks(matchers, loop, rows)
    fill_bitmasks(matchers, par, rows, executor=llguidance.LLExecutor(num_threads=2))
    np.testing.assert_array_equal(par, loop)
    assert all(loop[r].any() for r in rows)


def test_fill_writes_into_a_view_of_a_packed_buffer(compiler, token_bytes):
    """The step builder can hand a slice of its one packed int32 buffer to the matchers."""
    words = compiler.vocab.words
    packed = np.random.default_rng(0).integers(-(2**31), 2**31, 7 + 3 * words, dtype=np.int32)
    before = packed.copy()
    view = packed[7:].reshape(3, words)
    m = GrammarMatcher(compiler.compile(StructuredOutputsParams(regex="ab|cd")))
    m.fill_bitmask(view, 2)
    np.testing.assert_array_equal(packed[: 7 + 2 * words], before[: 7 + 2 * words])
    got = np.flatnonzero(unpack_bitmask(view[2], compiler.vocab.vocab_size))
    want = [
        t for t, b in enumerate(token_bytes) if b and (b"ab".startswith(b) or b"cd".startswith(b))
    ]
    assert list(got) == want and len(got) >= 2
    with pytest.raises(ValueError, match="int32"):
        m.fill_bitmask(view.astype(np.int64), 0)
    with pytest.raises(ValueError, match="rows must be in"):
        m.fill_bitmask(view, 3)


def test_byte_tokenizer_vocabulary(token_bytes):
    """The byte presets' tokenizer (ids 0..255 bytes, 256 bos, 257 eos, 258 pad) in a model
    vocabulary of 272."""
    c = GrammarCompiler(ByteTokenizer(), 272, eos_ids=[257])
    rng = random.Random(4)
    schema = random_root_schema(11)
    m = GrammarMatcher(c.compile(StructuredOutputsParams(json=schema)))
    bitmask = np.zeros((1, bitmask_words(272)), np.int32)
    out = bytearray()
    for _ in range(2000):
        m.fill_bitmask(bitmask, 0)
        allowed = np.flatnonzero(unpack_bitmask(bitmask[0], 272))
        assert allowed.max() <= 257 and 256 not in allowed and 258 not in allowed
        closing = [t for t in allowed if t == 257 or (t < 256 and t in b'"]}')]
        t = int(rng.choice(closing if closing and rng.random() < 0.4 else list(allowed)))
        assert m.accept_token(t)
        if t == 257:
            break
        out.append(t)
    assert m.is_terminated()
    assert_valid(out.decode("utf-8"), schema)
    c.close()


def test_apply_bitmask_ref_matches_a_loop():
    rng = np.random.default_rng(0)
    for vocab in (1, 31, 32, 100, 257):
        logits = rng.standard_normal((3, vocab)).astype(np.float32)
        bitmask = rng.integers(-(2**31), 2**31, (3, bitmask_words(vocab)), dtype=np.int32)
        got = apply_bitmask_ref(logits, bitmask)
        for b in range(3):
            for t in range(vocab):
                allowed = (int(bitmask[b, t // 32]) >> (t % 32)) & 1
                assert got[b, t] == (logits[b, t] if allowed else -np.inf)
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask_ref(logits, bitmask[:, :-1])


def test_a_grammar_with_a_reasoning_end_starts_after_it(compiler, tokenizer):
    """Before `reasoning_end_ids` every token is allowed and none reaches the grammar; after
    them the grammar holds; rollback and draft validation cross that point either way."""
    ids = lambda text: tokenizer.encode(text).ids  # noqa: E731
    end = (*ids("!"), *ids("?"))
    compiled = compiler.compile(StructuredOutputsParams(choice=["yes"], reasoning_end_ids=end))
    m = GrammarMatcher(compiled)
    out = np.zeros((2, compiler.vocab.words), np.int32)
    thought = [*ids("no! yes"), *end]
    for t in thought:
        m.fill_bitmask(out, 1)
        assert (out[1] == -1).all() and not m.must_stop() and m.error is None
        assert m.accept_token(t)
    m.fill_bitmask(out, 1)
    allowed = unpack_bitmask(out[1], compiler.vocab.vocab_size)
    assert allowed[ids("yes")[0]] and not allowed[ids("no")[0]] and not allowed[0]
    answer = [*ids("yes"), 0]
    assert m.validate_tokens(answer) == len(answer)
    m.rollback(1)  # the end's last token: reasoning again
    m.fill_bitmask(out, 1)
    assert (out[1] == -1).all()
    assert m.validate_tokens([end[-1], *answer]) == 1 + len(answer)
    assert m.validate_tokens([*ids("x"), 0, 5]) == 2  # a stop ends the reasoning's output
    for t in [end[-1], *answer]:
        assert m.accept_token(t)
    assert m.is_terminated() and m.num_tokens == len(thought) + len(answer)
    m.rollback(len(answer) + 2)
    assert m.accept_token(0) and m.is_terminated() and m.must_stop()  # stopped while reasoning
    assert not m.accept_token(ids("y")[0])


def test_added_tokens_that_are_text_are_allowed_and_accepted_as_text(tokenizer):
    """Qwen's `<tool_call>` and `<think>` are added tokens that are not special, so text to a
    grammar. llguidance alone takes them for special tokens, yet offers one where a grammar
    forces its text, and then refuses it (the request would end in an error); here the mask
    offers the tag's text and the token, sampled, is accepted."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    call = tok.token_to_id("<tool_call>")
    c = GrammarCompiler(tok, tok.get_vocab_size() + 3, eos_ids=[0])
    try:
        m = GrammarMatcher(c.compile(StructuredOutputsParams(regex=r"<tool_call>[0-9]")))
        out = np.zeros((1, c.vocab.words), np.int32)
        m.fill_bitmask(out)
        for t in np.flatnonzero(unpack_bitmask(out[0], c.vocab.vocab_size)):
            assert m.validate_tokens([int(t)]) == 1, t
        assert m.accept_token(call) and m.validate_tokens([*tok.encode("7").ids, 0]) == 2
    finally:
        c.close()
