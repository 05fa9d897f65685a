"""Draft-model speculative decoding (`jaxmamba.model.draft`, docs/speculative.md): a second
model proposes the drafts inside the verify step and keeps its own per-slot state.

The oracle is a draft equal to the target: its greedy drafts are the target's own argmax, so
every one must be accepted, and its cache must equal the target's after every step whatever
was accepted (sampled rows reject some drafts, so the rollback is exercised). A smaller
random draft of another family (Gated DeltaNet for a Mamba2 target) checks that greedy output
stays the non-speculative one token for token, and sampled output keeps the target's
distribution."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.engine.batch import Bucket
from jaxmamba.engine.config import EngineConfig

from model_helpers import FORBIDDEN, assert_same_token_distribution, primitive_names

TARGET = "nemotron-h-tiny"
# Prompts longer than a step (chunked prefill), a short one that decodes beside a long one's
# prefill (mixed steps), shared prefixes (prefix-cache hits), n = 2 (forks).
ENGINE = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=16, page_size=16,
              enable_prefix_caching=True, num_state_slots=8, compilation_cache=False,
              dtype="float32")  # fmt: skip
SELF_DRAFT = {"method": "draft_model", "model": TARGET, "num_speculative_tokens": 3}

# A small Gated DeltaNet + attention model on the target's byte-level vocabulary (random
# weights): a draft of another family and chunk size than the target.
GDN_DRAFT = """\
model_type: qwen3_5_text
vocab_size: 272
hidden_size: 32
layer_types: [gdn, mlp, attention, mlp]
norm_eps: 1.0e-06
tie_word_embeddings: true
mamba_num_heads: 0
mamba_head_dim: 0
n_groups: 0
ssm_state_size: 0
conv_kernel: 4
chunk_size: 64
use_conv_bias: false
mamba_proj_bias: false
time_step_limit: [0.0, .inf]
residual_in_fp32: false
num_attention_heads: 2
num_key_value_heads: 1
head_dim: 16
attention_bias: false
intermediate_size: 64
mlp_bias: false
mlp_activation: silu_glu
bos_token_id: 256
eos_token_id: 257
pad_token_id: 258
rope_theta: 10000.0
rope_dim: 8
attention_output_gate: true
attention_qk_norm: true
gdn_num_key_heads: 1
gdn_num_value_heads: 2
gdn_key_head_dim: 16
gdn_value_head_dim: 16
"""

rng = np.random.default_rng(0)
LONG = rng.integers(0, 256, 90).tolist()
PROMPTS = [rng.integers(0, 256, 9).tolist(), LONG]
SHARED = LONG[:70] + rng.integers(0, 256, 12).tolist()  # a prefix-cache hit on LONG's blocks


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft") / "gdn-draft.yaml"
    path.write_text(GDN_DRAFT)
    gdn = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4}
    with pytest.MonkeyPatch.context() as mp:
        # One sampler program a bucket (the full one): half the compiles. The variants
        # change the sampler only, not the drafting.
        mp.setenv("JAXMAMBA_SAMPLER_VARIANTS", "0")
        return {
            "base": LLM(TARGET, **ENGINE),
            "self": LLM(TARGET, speculative_config=SELF_DRAFT, **ENGINE),
            "gdn": LLM(TARGET, speculative_config=gdn, **ENGINE),
        }


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _generate(llm, prompts, params):
    return llm.generate(None, params, prompt_token_ids=prompts, use_tqdm=False)


@pytest.fixture(scope="module")
def base_greedy(engines):
    return _greedy_runs(engines["base"])


def _greedy_runs(llm):
    """Greedy outputs of a batch with chunked prefill and mixed steps, then of a prompt that
    hits the first one's cached prefix, with n = 2."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    first = _generate(llm, PROMPTS, greedy)
    second = _generate(llm, [SHARED], SamplingParams(max_tokens=20, temperature=0,
                                                     ignore_eos=True, n=2))  # fmt: skip
    assert second[0].num_cached_tokens > 0
    return _tokens(first) + _tokens(second)


def test_a_draft_equal_to_the_target_has_every_draft_accepted(engines, base_greedy):
    llm = engines["self"]
    assert _greedy_runs(llm) == base_greedy
    stats = llm.stats()
    assert stats["spec_verify_steps"] > 0
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["steps"] < engines["base"].stats()["steps"]


def test_a_smaller_draft_of_another_family_keeps_greedy_output_identical(engines, base_greedy):
    llm = engines["gdn"]
    assert llm.runner.speculative.model.cfg.chunk_size == llm.model_cfg.chunk_size
    assert _greedy_runs(llm) == base_greedy
    assert llm.stats()["spec_verify_steps"] > 0


def test_each_slot_and_page_holds_the_drafts_state_too(engines):
    base, draft = engines["base"].cache_plan, engines["self"].cache_plan
    conv, state = engines["self"].model_cfg.slot_state_elements()
    assert draft.per_slot - base.per_slot == 4 * (conv + state)  # float32 states and windows
    assert draft.per_page == 2 * base.per_page


def _assert_same_cache(a, b, num_slots, num_pages):
    for name in ("conv", "ssm"):  # every slot but the pad sink
        for x, y in zip(getattr(a, name), getattr(b, name), strict=True):
            np.testing.assert_allclose(x[:num_slots], y[:num_slots], rtol=1e-4, atol=1e-5)
    for name in ("k_pages", "v_pages"):
        for x, y in zip(getattr(a, name), getattr(b, name), strict=True):
            np.testing.assert_allclose(x[:num_pages], y[:num_pages], rtol=1e-4, atol=1e-5)


def test_a_draft_equal_to_the_target_keeps_the_targets_cache_after_rejections(engines):
    """Sampled rows reject some of the (greedy) drafts; the draft's states, checkpoints and
    KV pages, rolled back to what the target kept each step, equal the target's."""
    llm = engines["self"]
    before = llm.stats()
    params = [SamplingParams(max_tokens=24, temperature=0.03, seed=s, ignore_eos=True)
              for s in range(2)]  # fmt: skip
    _generate(llm, PROMPTS, params)
    _generate(llm, [SHARED], SamplingParams(max_tokens=16, temperature=0.03, seed=7, n=2,
                                            ignore_eos=True))  # fmt: skip
    after = llm.stats()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < drafted  # some drafts kept, some rolled back
    spec = llm.runner.cache_spec
    _assert_same_cache(llm.runner.cache, llm.runner.slot_state.spec.draft, spec.num_slots,
                       spec.num_pages)  # fmt: skip


def test_seeded_sampling_reproduces_with_a_draft_model(engines):
    llm = engines["gdn"]
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=1234)
    assert _tokens(_generate(llm, PROMPTS, params)) == _tokens(_generate(llm, PROMPTS, params))


def test_sampling_with_a_draft_model_keeps_the_target_distribution(engines):
    """The drafts are the draft model's argmax, a point mass given the context, so the
    verify step's rule (accept d with probability p(d), else draw from p without d) emits
    every token distributed as the target's p (`test_speculative.py::
    test_rejection_sampling_keeps_the_target_distribution` checks the rule exactly). Here, at
    temperature 0.03 (the random model's logits are close together: its likeliest token has
    p of about 0.5 there) over 96 samples, the second to fourth tokens with and without the
    draft model pass a chi-square test of homogeneity (p > 1e-4; fixed seeds: deterministic)."""

    params = [SamplingParams(max_tokens=4, temperature=0.03, seed=s, n=4, ignore_eos=True)
              for s in range(24)]  # fmt: skip
    prompt = [PROMPTS[0]] * len(params)
    runs = {}
    for name in ("base", "self"):
        llm = engines[name]
        before = llm.stats().get("spec_accepted_tokens", 0)
        runs[name] = np.array([c.token_ids for o in _generate(llm, prompt, params)
                               for c in o.outputs])  # fmt: skip
        if name == "self":
            assert llm.stats()["spec_accepted_tokens"] > before
    assert_same_token_distribution(runs["base"], runs["self"], positions=(1, 2, 3))


def test_draft_verify_programs_have_no_host_callback_nor_branch(engines):
    llm = engines["gdn"]
    runner, builder = llm.runner, llm.engine.builder
    for sampler in ("full", "greedy"):
        bucket = Bucket(2 * 5, 2, 2)
        step = functools.partial(runner._step_fn, num_decode=2, sampler=sampler)
        jaxpr = jax.make_jaxpr(step)(runner.params, runner.cache, runner.slot_state,
                                     builder.padding(bucket)).jaxpr  # fmt: skip
        names = primitive_names(jaxpr)
        assert "scan" in names  # the draft's passes
        assert not [n for n in names if any(f in n for f in FORBIDDEN)], names
        assert not {"cond", "switch", "while"} & names, sampler


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "draft_model", "model": TARGET, "prompt": 1}, "prompt"),
        ({"method": "mtp", "model": TARGET}, "method 'mtp' drafts with the target's own"),
    ],
)
def test_bad_draft_configs_are_refused_by_name(config, names):
    with pytest.raises(ValueError, match=names):
        EngineConfig(speculative_config=config)


def test_a_draft_of_another_vocabulary_is_refused():
    other = {"method": "draft_model", "model": "qwen3-next-tiny"}
    with pytest.raises(ValueError, match="vocab_size 512 differs from the target's 272"):
        LLM(TARGET, speculative_config=other, **ENGINE)


def test_a_runner_needs_the_draft_weights_with_a_draft_spec(engines):
    from jaxmamba.engine.runner import ModelRunner

    runner = engines["self"].runner
    with pytest.raises(ValueError, match="draft_params"):
        ModelRunner(runner.cfg, runner.params, runner.cache_spec,
                    speculative=runner.speculative)  # fmt: skip
