"""Structured outputs through the engine: a random-weight model's completions parse and
validate against their schema, match their regex, are one of their choices; the device's mask
against `apply_bitmask_ref`; constrained rows beside unconstrained ones, n > 1, logprobs, stop
strings, prefix caching; bad constraints; no compile after warm-up."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams, StructuredOutputsParams
from jaxmamba.model.sampling import apply_token_bitmask, sample
from jaxmamba.structured import apply_bitmask_ref, bitmask_words

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PERSON_KEYS = tuple(PERSON["properties"])
REGEX = r"[a-f]{2,4}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue", "yellow"]
PROMPTS = ["Answer:", "Colour?", "x"]  # short: a batch of them prefills in one step


def conforms_to_person(doc) -> bool:
    """`PERSON`, checked by hand (no JSON-schema validator in the test environment)."""
    if not isinstance(doc, dict) or not {"name", "age", "role"} <= set(doc) <= set(PERSON_KEYS):
        return False
    age, tags = doc["age"], doc.get("tags", [])
    return (
        isinstance(doc["name"], str) and len(doc["name"]) <= 6
        and isinstance(age, int) and not isinstance(age, bool) and 0 <= age <= 120
        and doc["role"] in ("admin", "user")
        and isinstance(tags, list) and len(tags) <= 3 and all(isinstance(t, bool) for t in tags)
    )  # fmt: skip


def constrained(max_tokens=80, **kwargs) -> SamplingParams:
    temperature = kwargs.pop("temperature", 0.0)
    constraint = StructuredOutputsParams(**kwargs)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                          structured_outputs=constraint)  # fmt: skip


@pytest.fixture(scope="module")
def llm():
    llm = LLM("nemotron-h-tiny", max_num_seqs=8, max_model_len=160, max_num_batched_tokens=64)
    # One decode bucket and one token bucket, and every batch prefills in one step: the tests
    # run the decode bucket's full, plain and greedy programs and the prefill buckets' full
    # ones, every FULL program with the bitmask.
    llm.engine.scheduler.use_buckets(decode=[8], tokens=[64])
    # (bucket, sampler, packed layout, whether the builder sent a bitmask) of every step run
    dispatched = llm.dispatched = []
    runner = llm.runner
    run_step, step = runner._run_step, runner.step
    built = []

    def recording_step(inputs, num_decode, **kwargs):
        built.append(inputs.token_bitmask is not None)
        return step(inputs, num_decode, **kwargs)

    def recording(inputs, bucket, sampler):
        dispatched.append((bucket, sampler, inputs.layout, built.pop()))
        return run_step(inputs, bucket, sampler)

    runner.step, runner._run_step = recording_step, recording
    return llm


def test_device_mask_matches_the_reference_on_random_logits():
    rng = np.random.default_rng(0)
    for rows, vocab in [(5, 272), (3, 100), (4, 64)]:
        logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
        bitmask = rng.integers(-(2**31), 2**31, (rows, bitmask_words(vocab)), dtype=np.int64)
        bitmask = bitmask.astype(np.int32)
        bitmask[0] = -1  # an unconstrained row
        bitmask[1, :] = 0
        bitmask[1, -1] = np.uint32(1 << (vocab - 1) % 32).view(np.int32)  # only the last token
        got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
        np.testing.assert_array_equal(got, apply_bitmask_ref(logits, bitmask))


@pytest.mark.parametrize("cutoff, top_logprobs, draw, ranks", [
    (True, True, True, True),  # FULL
    (False, False, True, True),  # PLAIN
    (False, False, False, False),  # GREEDY
], ids=["full", "plain", "greedy"])  # fmt: skip
def test_every_sampler_program_samples_only_allowed_tokens(cutoff, top_logprobs, draw, ranks):
    """Greedy rows take the argmax of the masked logits, drawing rows an allowed token; the
    logprobs stay the raw model's."""
    rng = np.random.default_rng(1)
    rows, vocab = 8, 200
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 4
    allowed = rng.random((rows, vocab)) < 0.1
    allowed[np.arange(rows), rng.integers(0, vocab, rows)] = True  # at least one per row
    allowed[-1] = True  # an unconstrained row
    words = np.zeros((rows, bitmask_words(vocab) * 32), bool)
    words[:, :vocab] = allowed
    bitmask = np.packbits(words, axis=-1, bitorder="little").view(np.int32)
    temperature = np.where(np.arange(rows) % 2 == 0, 0.0, 1.5).astype(np.float32) if draw else (
        np.zeros(rows, np.float32))  # fmt: skip
    top_k = np.where(cutoff, 5, 0) * np.ones(rows, np.int32)
    fn = jax.jit(lambda *a: sample(*a, cutoff=cutoff, top_logprobs=top_logprobs, draw=draw,
                                   ranks=ranks))  # fmt: skip
    out = fn(logits, temperature, np.ones(rows, np.float32), top_k,
             np.arange(rows, dtype=np.uint32), np.zeros(rows, np.int32), None, None, None, None,
             None, None, jnp.asarray(bitmask))  # fmt: skip
    tokens = np.asarray(out.tokens)
    assert allowed[np.arange(rows), tokens].all(), tokens
    masked = apply_bitmask_ref(logits, bitmask)
    greedy = temperature == 0
    np.testing.assert_array_equal(tokens[greedy], masked.argmax(-1)[greedy])
    raw = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(rows), tokens], rtol=1e-5, atol=1e-5)


def test_builder_writes_each_constrained_rows_mask_and_no_bitmask_without_one():
    """A mixed step with filler decode rows: each constrained row's bitmask is its matcher's,
    at its row; the others allow every token. A complete grammar's row keeps its stop ids
    unmasked by min_tokens. Without a constrained row the step has no bitmask."""
    from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder
    from jaxmamba.step_contract import CacheSpec
    from jaxmamba.structured import GrammarCompiler, GrammarMatcher
    from jaxmamba.tokenizer import ByteTokenizer

    vocab = 272
    compiler = GrammarCompiler(ByteTokenizer(), vocab, eos_ids=[257])
    builder = StepBuilder(CacheSpec(num_slots=16, num_pages=64, page_size=4), 8, vocab, 4)
    regex = GrammarMatcher(compiler.compile(StructuredOutputsParams(regex="[0-9]+")))
    done = GrammarMatcher(compiler.compile(StructuredOutputsParams(choice=["ab"])))
    assert done.accept_token(ord("a")) and done.accept_token(ord("b")) and done.must_stop()

    def row(slot, tokens, prefix, **kw):
        return RowSpec(tokens, prefix, slot, list(range(4 * slot, 4 * slot + 4)), **kw)

    rows = [row(0, [5], 3, matcher=regex),  # a decode row; the bucket adds a filler after it
            row(1, [7, 8, 9], 0),
            row(2, [1, 2], 0, matcher=done, min_tokens=4, stop_ids=(257,))]  # fmt: skip
    bucket = Bucket(num_tokens=16, num_rows=6, num_decode=2)
    x = builder.build(rows, bucket, num_decode_rows=1)
    want = np.full((6, bitmask_words(vocab)), -1, np.int32)
    regex.fill_bitmask(want, 0)
    done.fill_bitmask(want, 3)  # after the filler decode row
    np.testing.assert_array_equal(x.token_bitmask, want)
    assert x.min_tokens[3] == 0 and (want[0] != -1).any() and (want[3] != -1).any()
    compiler.close()
    unconstrained = [row(0, [5], 3), row(1, [7, 8, 9], 0)]
    assert builder.build(unconstrained, bucket, num_decode_rows=1).token_bitmask is None


def test_completions_satisfy_their_constraints_beside_unconstrained_rows(llm):
    """Schema, regex, choice and json_object rows in one batch with unconstrained greedy rows,
    which give exactly the tokens they give alone."""
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    # A random model writes endless keys; the bias makes its object end soon.
    bias = {ord('"'): 4.0, ord("}"): 3.0}
    any_object = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    json_object = SamplingParams(max_tokens=60, temperature=0.0, logit_bias=bias,
                                 structured_outputs=any_object)  # fmt: skip
    params = [
        constrained(json=PERSON, disable_any_whitespace=True, max_tokens=100),
        plain,
        constrained(regex=REGEX),
        constrained(choice=CHOICES),
        plain,
        json_object,
    ]
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (outs[1], outs[4])] == [
        a.outputs[0].token_ids for a in alone
    ]
    person, _, regex, choice, _, obj = (o.outputs[0] for o in outs)
    assert person.finish_reason == "stop" and conforms_to_person(json.loads(person.text)), person
    assert regex.finish_reason == "stop" and re.fullmatch(REGEX, regex.text), regex
    assert choice.finish_reason == "stop" and choice.text in CHOICES, choice
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict), obj
    assert json.loads(obj.text), obj  # not just {}
    assert all(o.error is None for o in outs)
    assert any(constrained for *_, constrained in llm.dispatched)


def test_n_samples_each_follow_their_grammar(llm):
    params = constrained(choice=CHOICES, temperature=1.0)
    params = SamplingParams(n=3, seed=3, max_tokens=10, temperature=1.0,
                            structured_outputs=params.structured_outputs)  # fmt: skip
    regex = SamplingParams(n=2, seed=4, max_tokens=20, temperature=0.7,
                           structured_outputs=StructuredOutputsParams(regex=REGEX))  # fmt: skip
    outs = llm.generate([PROMPTS[1], PROMPTS[0]], [params, regex], use_tqdm=False)
    assert len(outs[0].outputs) == 3 and len(outs[1].outputs) == 2
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in outs[0].outputs)
    assert all(re.fullmatch(REGEX, c.text) for c in outs[1].outputs), outs[1].outputs


def test_a_constraint_with_a_reasoning_end_starts_after_it(llm):
    """The grammar starts after `reasoning_end_ids` (here "#", which the biased model writes
    soon); what comes before is free, and rows in their free part still carry their matcher's
    mask (all-allowing) and run FULL."""
    bias = {ord("#"): 3.0, llm.tokenizer.eos_token_id: -100.0}
    constraint = StructuredOutputsParams(regex=REGEX, reasoning_end_ids=(ord("#"),))
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=7, logit_bias=bias,
                            structured_outputs=constraint, n=3)  # fmt: skip
    [out] = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    for c in out.outputs:
        thought, end, answer = c.text.partition("#")
        assert end and c.finish_reason == "stop", c
        assert re.fullmatch(REGEX, answer), c.text


def test_max_tokens_cut_says_length(llm):
    out = llm.generate(["abc"], constrained(regex="[a-z]{40}", max_tokens=5), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert re.fullmatch("[a-z]{5}", c.text), c.text


def test_a_complete_grammar_stops_even_with_ignore_eos(llm):
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))  # fmt: skip
    c = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.text in CHOICES


def test_logprobs_are_the_raw_models_and_stop_strings_cut(llm):
    """The first token's top logprobs are the unconstrained model's at the same prompt; a stop
    string inside the grammar's output ends it there."""
    free = SamplingParams(max_tokens=1, temperature=0.0, logprobs=3)
    one = StructuredOutputsParams(choice=["zq-zq"])
    choice = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, structured_outputs=one)
    stopped = SamplingParams(max_tokens=20, temperature=0.0, stop=["-"],
                             structured_outputs=StructuredOutputsParams(regex=REGEX))  # fmt: skip
    outs = llm.generate([PROMPTS[0]] * 3, [free, choice, stopped], use_tqdm=False)
    raw, got = outs[0].outputs[0].logprobs[0], outs[1].outputs[0].logprobs[0]
    top = lambda d: {t: (round(p.logprob, 4), p.rank) for t, p in d.items() if p.rank <= 3}  # noqa: E731
    assert top(got) == top(raw)
    assert outs[1].outputs[0].text == "zq-zq" and outs[1].outputs[0].token_ids[0] == ord("z")
    s = outs[2].outputs[0]
    assert s.finish_reason == "stop" and s.stop_reason == "-" and re.fullmatch("[a-f]{2,4}", s.text)


def test_prefix_cache_hits_give_the_same_constrained_output(llm):
    prompt = "A shared system prompt that fills several blocks of the cache."
    params = constrained(json=PERSON, disable_any_whitespace=True, max_tokens=100)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    hits = llm.stats()["prefix_cache_hits"]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.stats()["prefix_cache_hits"] > hits and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert conforms_to_person(json.loads(again.outputs[0].text))


def test_a_grammar_dead_end_ends_the_sample_with_an_error(llm):
    """A schema whose $ref is itself compiles, and fails once the value is due: the sample
    ends with finish_reason "error" and says why; the other request is unharmed."""
    loop = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
            "$defs": {"x": {"$ref": "#/$defs/x"}}}  # fmt: skip
    params = constrained(json=loop, disable_any_whitespace=True,
                         disable_additional_properties=True)  # fmt: skip
    outs = llm.generate(["x", "x"], [params, constrained(choice=CHOICES)], use_tqdm=False)
    bad = outs[0].outputs[0]
    assert bad.finish_reason == "error" and "cannot go on" in outs[0].error, outs[0]
    assert bad.text.startswith('{"a"') and outs[0].outputs[0].token_ids
    assert outs[1].outputs[0].text in CHOICES and outs[1].error is None


@pytest.mark.parametrize("kwargs, error, words", [
    ({"regex": "(a"}, ValueError, "regex"),
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, ValueError,
     "uniqueItems"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 2}}, ValueError, "minimum"),
    ({"grammar": 'root ::= "a" | nowhere'}, ValueError, "nowhere"),
], ids=["regex", "unenforceable", "unsatisfiable", "grammar"])  # fmt: skip
def test_bad_constraints_raise_before_anything_runs(llm, kwargs, error, words):
    steps = llm.stats()["steps"]
    good = constrained(choice=CHOICES)
    with pytest.raises(error, match=f"(?s)prompt 1: .*{re.escape(words)}"):
        llm.generate(["x", "y"], [good, constrained(**kwargs)], use_tqdm=False)
    assert llm.stats()["steps"] == steps and not llm.engine.has_unfinished_requests()
    assert llm.generate(["x"], good, use_tqdm=False)[0].outputs[0].text in CHOICES


def test_wrong_types_and_unsupported_runners_are_refused(llm, monkeypatch):
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": PERSON})
    with pytest.raises(TypeError, match="choice"):
        StructuredOutputsParams(choice="red")
    monkeypatch.setattr(llm.runner, "structured_outputs", False)
    refusal = "FULL sampler programs that take the token bitmask.*an exported artifact"
    with pytest.raises(ValueError, match=refusal):
        llm.generate(["x"], constrained(choice=CHOICES), use_tqdm=False)
    steps = len(llm.dispatched)
    assert llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    del llm.dispatched[steps:]  # FULL without the bitmask: not this engine's program


def test_a_grammar_that_fails_to_compile_fails_its_request_in_the_streaming_engine(
    llm, monkeypatch
):
    """`LLMEngine.add_request` does not wait for the compile (the server awaits it first):
    a compile that fails later ends the request with finish_reason "error", never
    unconstrained."""
    from concurrent.futures import Future

    engine = llm.engine
    failed = Future()
    failed.set_exception(ValueError("structured_outputs.json: a compile that failed late"))
    compile_grammar = engine.compile_grammar
    monkeypatch.setattr(engine, "compile_grammar",
                        lambda c: failed if c.kind == "json" else compile_grammar(c))  # fmt: skip
    engine.add_request("bad", "x", constrained(json={"type": "object"}))
    engine.add_request("good", "x", constrained(choice=CHOICES))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in final:
                final[out.request_id].add(out)
            else:
                final[out.request_id] = out
    assert final["bad"].outputs[0].finish_reason == "error"
    assert "failed late" in final["bad"].error and final["bad"].outputs[0].token_ids == []
    assert final["good"].outputs[0].text in CHOICES and final["good"].error is None


def test_every_full_program_takes_the_bitmask_and_nothing_recompiles(llm):
    """Every step ran a program `programs` lists (what precompile and memory sizing compile),
    with the inputs its warm-up builds: every FULL program carries the bitmask (all-allowing
    unless a row has a grammar), PLAIN and GREEDY none, and a step with a constrained row runs
    FULL; the programs are as many as with structured outputs off. A batch like the last but
    for its grammars compiles nothing."""
    from jaxmamba.engine.runner import FULL
    from jaxmamba.model.metadata import PackedStepInputs

    def run(enum, regex):
        schema = {"type": "object", "properties": {"k": {"enum": enum}}, "required": ["k"]}
        params = [constrained(json=schema, disable_any_whitespace=True),
                  SamplingParams(max_tokens=4, temperature=0.0),
                  constrained(regex=regex, temperature=0.5)]  # fmt: skip
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert json.loads(outs[0].outputs[0].text)["k"] in enum
        assert re.fullmatch(regex, outs[2].outputs[0].text)

    run([1, 2, 3], "[0-9]{3}")
    compiles = llm.runner.num_compiles
    run([4, 5, 6], "[a-z]{3}")
    assert llm.runner.num_compiles == compiles
    runner, engine = llm.runner, llm.engine
    # plain greedy rows: the decode steps run GREEDY
    llm.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    buckets = engine.scheduler.all_buckets()
    programs = runner.programs(buckets)
    decode = [b for b in buckets if b.num_decode == b.num_rows]
    assert len(programs) == len(buckets) + 2 * len(decode)  # no program twice for the bitmask
    seen = set()
    for bucket, sampler, layout, constrained_row in llm.dispatched:
        program = next(p for p in programs if p[1] == sampler
                       and (p[0].num_tokens, p[0].num_rows, p[0].num_decode) == bucket)  # fmt: skip
        warm_up = runner.program_inputs(program, engine.builder.padding)
        assert PackedStepInputs.pack(warm_up).layout == layout, program
        has_bitmask = "token_bitmask" in [name for name, _, _ in layout]
        assert has_bitmask == (sampler == FULL), program
        assert sampler == FULL or not constrained_row, program
        seen.add((sampler, constrained_row))
    assert {("full", True), ("full", False), ("greedy", False)} <= seen, seen


TP_SCRIPT = """
import json, sys
from jaxmamba import LLM, SamplingParams, StructuredOutputsParams
seen = {}
for n in (1, 2):
    llm = LLM("nemotron-h-demo", tensor_parallel_size=n, max_num_seqs=2, max_model_len=128,
              compilation_cache=False)
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=1,
                             structured_outputs=StructuredOutputsParams(**kw))
              for kw in ({"regex": "[a-z]{3}_[0-9]{2}"}, {"choice": ["alpha", "beta"]})]
    outs = llm.generate(["def main(", "x = "], params, use_tqdm=False)
    seen[n] = [(o.outputs[0].text, o.outputs[0].token_ids,
                [c[t].logprob for c, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
               for o in outs]
json.dump(seen, open(sys.argv[1], "w"))
"""


def test_constrained_requests_under_tensor_parallelism_equal_one_device(tmp_path):
    """TP 2 (two CPU devices, in a fresh process): the sharded FULL program takes the token
    bitmask, so a regex and a choice give one device's tokens and logprobs."""
    out = tmp_path / "seen.json"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", TP_SCRIPT, str(out)], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    seen = json.loads(out.read_text())
    (regex, choice) = seen["1"]
    assert re.fullmatch("[a-z]{3}_[0-9]{2}", regex[0]) and choice[0] in ("alpha", "beta")
    for one, two in zip(seen["1"], seen["2"], strict=True):
        assert one[:2] == two[:2]
        np.testing.assert_allclose(one[2], two[2], atol=2e-4)
