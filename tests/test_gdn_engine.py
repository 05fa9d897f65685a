"""Gated DeltaNet hybrids through the whole engine, on the `qwen3-next-tiny` preset (random
weights; the HF parity of the family is tests/test_family_qwen3_next.py): steps that never
touch the host nor recompile, prefix caching that hits at branch points on GDN checkpoints,
n > 1 forks, an exported artifact, and tensor parallelism equal to one device."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.engine.batch import Bucket
from jaxmamba.engine.runner import FULL
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params

from model_helpers import FORBIDDEN, builder, make_runner, primitive_names, row

PRESET = "qwen3-next-tiny"
# Blocks of lcm(chunk 64, page 16) = 64 tokens; 6 programs (decode 1 / 4 rows; 64 / 256
# step tokens) keep XLA:CPU's compiles few.
ENGINE = dict(max_num_seqs=4, max_model_len=384, max_num_batched_tokens=256, max_prefill_seqs=4,
              page_size=16, num_state_slots=12, num_pages=120, compilation_cache=False)  # fmt: skip


@pytest.fixture(scope="module")
def runner():
    cfg = config_from_preset(PRESET)
    return make_runner(cfg, init_params(cfg, seed=0))


def test_gdn_step_jaxprs_have_no_host_callbacks_and_decode_no_branch(runner):
    rng = np.random.default_rng(0)
    vocab = runner.cfg.vocab_size
    for bucket in (Bucket(64, 4, 0), Bucket(4, 4, 4), Bucket(32, 4, 2)):
        rows = [row([int(rng.integers(vocab))], 5, slot=i) for i in range(bucket.num_decode)]
        rows += [row(rng.integers(0, vocab, n).tolist(), 0, slot=bucket.num_decode + i)
                 for i, n in enumerate([9, 3])][: bucket.num_rows - bucket.num_decode]  # fmt: skip
        inputs = builder(runner).build(rows, bucket)
        step = functools.partial(runner._step_fn, num_decode=bucket.num_decode, sampler=FULL)
        jaxpr = jax.make_jaxpr(step)(runner.params, runner.cache, runner.slot_state, inputs)
        names = primitive_names(jaxpr.jaxpr)
        assert not [n for n in names if any(f in n for f in FORBIDDEN)], names
        if bucket.num_decode == bucket.num_rows:
            assert not {"cond", "switch"} & names


def test_gdn_steps_run_under_transfer_guard_without_recompiling(runner):
    bld, rng, vocab = builder(runner), np.random.default_rng(1), runner.cfg.vocab_size
    prefill, decode, mixed = Bucket(64, 4, 0), Bucket(4, 4, 4), Bucket(32, 4, 2)

    def run(rows, bucket, decode_rows=None):
        inputs = bld.build(rows, bucket, num_decode_rows=decode_rows)
        with jax.transfer_guard("disallow"):
            packed = runner.step(inputs, bucket.num_decode, top_logprobs=False)
            return jax.device_get(packed)

    def prompts(lengths, first_slot):
        return [row(rng.integers(0, vocab, n).tolist(), 0, slot=first_slot + i)
                for i, n in enumerate(lengths)]  # fmt: skip

    run(prompts([20, 7, 1, 30], 0), prefill)
    run([row([1], 20, slot=0)], decode)
    run([row([1], 20, slot=0), row([3, 4, 5], 0, slot=1)], mixed, decode_rows=1)
    warm = runner.num_compiles
    for lengths in ([1], [63], [16, 16, 16, 16], [5, 40]):
        run(prompts(lengths, 2), prefill)
    for n in (1, 3, 4):
        run([row([int(rng.integers(vocab))], 40 + i, slot=i, temperature=0.7, seed=i)
             for i in range(n)], decode)  # fmt: skip
    run([row([2], 30, slot=0), row(rng.integers(0, vocab, 25).tolist(), 0, slot=3)], mixed,
        decode_rows=1)  # fmt: skip
    # A decode row crossing its checkpoint length copies its state in the same program.
    run([row([2], 63, slot=0, track_slot=8, track_len=64)], decode)
    assert runner.num_compiles == warm


def greedy(max_tokens=6, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def make_llm(**kw):
    llm = LLM(PRESET, **{**ENGINE, **kw})
    llm.engine.scheduler.use_buckets(decode=[1, 4], tokens=[64, 256])
    return llm


@pytest.fixture(scope="module")
def llm_off():
    return make_llm(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def llm_on():
    return make_llm(track_interval=64)  # decode checkpoints every block


def tokens_and_logprobs(outs):
    return [(o.outputs[0].token_ids,
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                             strict=True)]) for o in outs]  # fmt: skip


def test_prefix_cache_hits_at_the_branch_point_of_a_shared_system_prompt(llm_off, llm_on):
    """Three requests share a 150-token system prompt and then differ: the second and third
    reuse the GDN (and conv) checkpoint at 128 tokens, the deepest block boundary inside the
    shared part, and their greedy tokens and logprobs equal the engine without caching."""
    rng = np.random.default_rng(3)
    system = rng.integers(0, 256, 150).tolist()
    prompts = [system + rng.integers(0, 256, n).tolist() for n in (20, 33, 7)]
    sp = greedy(logprobs=1)
    ref = tokens_and_logprobs(llm_off.generate(prompt_token_ids=prompts, sampling_params=sp,
                                               use_tqdm=False))  # fmt: skip
    llm_on.reset_prefix_cache()
    outs = [llm_on.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False)[0]
            for p in prompts]  # fmt: skip
    assert [o.num_cached_tokens for o in outs] == [0, 128, 128]
    got = tokens_and_logprobs(outs)
    for (t_ref, lp_ref), (t, lp) in zip(ref, got, strict=True):
        assert t == t_ref
        np.testing.assert_allclose(lp, lp_ref, atol=2e-4)


def test_decode_checkpoints_serve_a_follow_up_turn(llm_off, llm_on):
    """A conversation's second turn extends the first turn's prompt and answer: it hits the
    checkpoint the decode steps took at a block boundary inside the answer."""
    rng = np.random.default_rng(4)
    first = rng.integers(0, 256, 60).tolist()
    llm_on.reset_prefix_cache()
    out = llm_on.generate(prompt_token_ids=[first], sampling_params=greedy(max_tokens=10),
                          use_tqdm=False)[0]  # fmt: skip
    follow = first + list(out.outputs[0].token_ids) + rng.integers(0, 256, 9).tolist()
    hit = llm_on.generate(prompt_token_ids=[follow], sampling_params=greedy(logprobs=1),
                          use_tqdm=False)[0]  # fmt: skip
    ref = llm_off.generate(prompt_token_ids=[follow], sampling_params=greedy(logprobs=1),
                           use_tqdm=False)[0]  # fmt: skip
    assert hit.num_cached_tokens == 64
    [(t, lp), (t_ref, lp_ref)] = tokens_and_logprobs([hit, ref])
    assert t == t_ref
    np.testing.assert_allclose(lp, lp_ref, atol=2e-4)


def test_n_greedy_samples_fork_the_gdn_state(llm_off):
    """n = 3 prefills once and copies the end state (GDN state, conv window, last KV page)
    into the other samples' slots: greedy samples all equal the single request's tokens."""
    prompt = np.random.default_rng(5).integers(0, 256, 45).tolist()
    one = llm_off.generate(prompt_token_ids=[prompt], sampling_params=greedy(), use_tqdm=False)
    many = llm_off.generate(prompt_token_ids=[prompt], sampling_params=greedy(n=3),
                            use_tqdm=False)  # fmt: skip
    assert [c.token_ids for c in many[0].outputs] == [one[0].outputs[0].token_ids] * 3


def test_an_exported_gdn_artifact_serves_the_live_engines_tokens(tmp_path, llm_off):
    from jaxmamba.export.writer import export_artifact

    engine = {k: v for k, v in ENGINE.items() if k != "compilation_cache"}
    engine.update(max_num_seqs=1, max_prefill_seqs=1, max_num_batched_tokens=64)
    buckets = [Bucket(1, 1, 1), Bucket(64, 1, 0)]
    out = export_artifact(PRESET, tmp_path / "art", engine=engine, buckets=buckets,
                          sampler_variants=False)  # fmt: skip
    served = LLM(str(out), compilation_cache=False)
    prompt = np.random.default_rng(6).integers(0, 256, 40).tolist()
    got = served.generate(prompt_token_ids=[prompt], sampling_params=greedy(logprobs=1),
                          use_tqdm=False)  # fmt: skip
    ref = llm_off.generate(prompt_token_ids=[prompt], sampling_params=greedy(logprobs=1),
                           use_tqdm=False)  # fmt: skip
    (t, lp), (t_ref, lp_ref) = tokens_and_logprobs(got)[0], tokens_and_logprobs(ref)[0]
    assert t == t_ref
    np.testing.assert_allclose(lp, lp_ref, atol=2e-4)


TP_SCRIPT = """
import json, sys
import numpy as np
from jaxmamba import LLM, SamplingParams
engine = json.loads(sys.argv[2])
prompts = json.loads(sys.argv[3])
sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
seen = {}
for size in (1, 2):
    llm = LLM("PRESET", tensor_parallel_size=size, **engine)
    llm.engine.scheduler.use_buckets(decode=[engine["max_num_seqs"]])
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    seen[size] = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in
                   zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]
try:
    LLM("PRESET", tensor_parallel_size=4, **engine)
except ValueError as e:
    seen["refused"] = str(e)
json.dump(seen, open(sys.argv[1], "w"))
""".replace("PRESET", PRESET)


def test_tensor_parallel_gdn_equals_one_device(tmp_path):
    """TP 2 splits the 6 GDN value heads 3 + 3 (one of the 2 key heads each), the query heads
    and the experts' hidden units; TP 4 cannot split 6 value heads and is refused naming it.
    Each size compiles three step programs: the 64-token prefill of both prompts (the second
    cut after 27 tokens), the second's last 10 tokens beside the first's decode row, and the
    decodes. One decode bucket of max_num_seqs rows serves every decode step (the rows finish
    a step apart): with the default ladder the last, 1-row step would be a fourth program."""
    out = tmp_path / "seen.json"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    engine = {**ENGINE, "max_num_batched_tokens": 64}
    prompts = np.random.default_rng(7).integers(0, 256, (2, 37)).tolist()
    proc = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, str(out), json.dumps(engine), json.dumps(prompts)],
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    seen = json.loads(out.read_text())
    for (t1, lp1), (t2, lp2) in zip(seen["1"], seen["2"], strict=True):
        assert t1 == t2
        np.testing.assert_allclose(lp1, lp2, atol=2e-4)
    assert "gdn_num_value_heads=6" in seen["refused"]


def test_the_openai_server_serves_a_gdn_model(llm_off):
    """/v1/completions on the GDN preset (a server engine with the same weights and pools as
    `llm_off`): the greedy tokens' logprobs `LLM.generate` gives, streamed or not (the preset
    has no tokenizer: the text is empty, the logprobs name the tokens)."""
    import httpx
    from test_server import ServerThread

    from jaxmamba.serve.api_server import ServerConfig

    llm = make_llm(enable_prefix_caching=False, params=llm_off.runner.params)
    thread = ServerThread(llm, ServerConfig(served_model_names=("qwen-tiny",)))
    try:
        prompt = np.random.default_rng(8).integers(0, 256, 30).tolist()
        ref = llm_off.generate(prompt_token_ids=[prompt], sampling_params=greedy(logprobs=1),
                               use_tqdm=False)[0].outputs[0]  # fmt: skip
        body = dict(model="qwen-tiny", prompt=prompt, max_tokens=6, temperature=0.0,
                    ignore_eos=True, logprobs=1)  # fmt: skip
        reply = httpx.post(f"{thread.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        lps = [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)]
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], lps, atol=2e-4)
        streamed = httpx.post(f"{thread.url}/v1/completions", json={**body, "stream": True},
                              timeout=120)  # fmt: skip
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        streamed_lps = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
        np.testing.assert_allclose(streamed_lps, lps, atol=2e-4)
    finally:
        thread.stop()
