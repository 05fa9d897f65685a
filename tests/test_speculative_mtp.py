"""MTP speculative decoding (`jaxmamba.model.mtp`, docs/speculative.md): a Qwen3-Next,
Qwen3.5 or Nemotron-H checkpoint's `mtp.*` layer drafts inside the verify step.

The checkpoints are transformers' random Qwen3NextForCausalLM, Qwen3_5ForCausalLM,
Qwen3_5MoeForConditionalGeneration and NemotronHForCausalLM with `mtp.*` tensors added under
vLLM's names (transformers drops them on load), the decoder layers taken from a model of the
same class with the MTP layer's layers, saved alike. The oracle of the head is those layers
run by transformers (float32), with the fc, norms and concatenation order of vLLM's
`qwen3_next_mtp.py` and `qwen3_5_mtp.py` (the same), or of its `nemotron_h_mtp.py`, written
out in float64 numpy."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxmamba import LLM, SamplingParams
from jaxmamba.engine.batch import Bucket
from jaxmamba.engine.config import SpeculativeConfig
from jaxmamba.model import step
from jaxmamba.model.families import load_config
from jaxmamba.model.loader import load_hf_checkpoint
from jaxmamba.model.model import Mamba2HybridLM
from jaxmamba.model.mtp import load_mtp, mtp_config, mtp_layers
from jaxmamba.model.step import build_metadata

from hf_fixtures import (
    GDN_LAYERS,
    make_nemotron_h_checkpoint,
    make_qwen3_5_checkpoint,
    make_qwen3_next_checkpoint,
    perturb_parameters,
)
from model_helpers import FORBIDDEN, builder, make_runner, primitive_names, row

ENGINE = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=16, page_size=16,
              enable_prefix_caching=True, num_state_slots=8, compilation_cache=False,
              dtype="float32")  # fmt: skip
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def _layer_class(config: dict):
    """transformers' text class of a checkpoint's config and its text config."""
    import transformers as tf

    text = config.get("text_config", config)
    name = {"qwen3_next": "Qwen3Next", "qwen3_5_text": "Qwen3_5",
            "qwen3_5_moe_text": "Qwen3_5Moe"}[text["model_type"]]  # fmt: skip
    return getattr(tf, f"{name}Config"), getattr(tf, f"{name}ForCausalLM"), text


def _add_mtp(path, seed: int, *, agree: bool = False):
    """Write `mtp.*` tensors into the checkpoint at `path` and its MTP layer count
    (`num_nextn_predict_layers`, or Qwen3.5's `mtp_num_hidden_layers`, in `text_config` for
    the multimodal config). `agree` (Qwen3-Next): the target and the head both predict one
    token whatever the context (the residual streams' dimension 0 dominates and the output
    norms keep only it, the lm_head rows are multiples of one vector), so every draft is
    accepted."""
    config = json.loads((path / "config.json").read_text())
    config_cls, model_cls, text = _layer_class(config)
    one = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")}
    one.update(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[])
    torch.manual_seed(seed)
    layer_model = model_cls(config_cls(**one)).float().eval()
    perturb_parameters(layer_model, seed)
    layer_dir = path / "mtp_layer"
    layer_model.save_pretrained(layer_dir)
    tensors = load_file(path / "model.safetensors")
    for name, x in load_file(layer_dir / "model.safetensors").items():
        if name.startswith("model.layers.0."):
            tensors["mtp.layers.0." + name.removeprefix("model.layers.0.")] = x
    rng = np.random.default_rng(seed)
    e = text["hidden_size"]
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = (0.2 * rng.standard_normal(e)).astype(np.float32)
    tensors["mtp.fc.weight"] = (rng.standard_normal((e, 2 * e)) / np.sqrt(2 * e)).astype(np.float32)
    if agree:
        only_first = np.full(e, -1.0, np.float32)  # zero-centred: scale 1 + w = e_0
        only_first[0] = 0.0
        tensors["model.embed_tokens.weight"][:, 0] = 60.0
        tensors["model.norm.weight"] = only_first
        tensors["mtp.norm.weight"] = only_first
        tensors["mtp.fc.weight"][0, 0] = 40.0  # the normed embedding's dimension 0
        tensors["lm_head.weight"] = np.outer(rng.standard_normal(text["vocab_size"]),
                                             np.eye(e)[0]).astype(np.float32)  # fmt: skip
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    key = (
        "num_nextn_predict_layers"
        if text["model_type"] == "qwen3_next"
        else "mtp_num_hidden_layers"
    )
    text[key] = 1
    (path / "config.json").write_text(json.dumps(config))
    return layer_model, tensors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, model = make_qwen3_next_checkpoint(tmp_path_factory.mktemp("mtp"), seed=0)
    layer_model, tensors = _add_mtp(path, seed=1)
    return path, model, layer_model, tensors


def _rms64(x, w):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * (1.0 + w.astype(np.float64))


def _oracle_logits(checkpoint, prompt) -> np.ndarray:
    """vLLM's MTP head at positions 0..n-2 of `prompt` (its logits predict tokens 2..n), in
    float64 (the decoder layer in float32): the target's final-normed hidden h_t and the
    embedding of token t + 1, each RMS-normed (x̂·(1 + w)), concatenated [embedding |
    hidden], `fc`, transformers' decoder layer under a causal mask, `mtp.norm`, the lm_head."""
    _, model, layer_model, t = checkpoint
    text = getattr(model.model, "language_model", model.model)  # a multimodal model's
    with torch.no_grad():
        hidden = text(torch.tensor([prompt])).last_hidden_state[0].double().numpy()
    n = len(prompt) - 1
    emb = text.embed_tokens.weight.detach().numpy()[prompt[1:]]
    x = np.concatenate([_rms64(emb, t["mtp.pre_fc_norm_embedding.weight"]),
                        _rms64(hidden[:n], t["mtp.pre_fc_norm_hidden.weight"])], -1)  # fmt: skip
    x = x @ t["mtp.fc.weight"].astype(np.float64).T
    layer_model.config._attn_implementation = "eager"
    xt = torch.tensor(x[None], dtype=torch.float32)  # transformers' grouped experts: no f64
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        rope = layer_model.model.rotary_emb(xt, positions)
        out = layer_model.model.layers[0](xt, position_embeddings=rope, attention_mask=mask,
                                          position_ids=positions)  # fmt: skip
    out = out[0] if isinstance(out, tuple) else out
    g = _rms64(out[0].double().numpy(), t["mtp.norm.weight"])
    return g @ t["lm_head.weight"].astype(np.float64).T


def test_mtp_head_logits_match_vllms_computation_in_numpy_and_transformers(checkpoint):
    _check_head_logits(checkpoint)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """Qwen3.5 dense (`Qwen3_5ForCausalLM`, `mtp_num_hidden_layers` at the top) and MoE as
    published (`Qwen3_5MoeForConditionalGeneration`: the text model under
    `model.language_model.`, the count in `text_config`, `mtp.*` at the top)."""
    out = {}
    for name, kw, seed in (("dense", {}, 5), ("moe", dict(moe=True, multimodal=True), 6)):
        path, model = make_qwen3_5_checkpoint(tmp_path_factory.mktemp(name), seed=seed, **kw)
        out[name] = (path, model, *_add_mtp(path, seed=seed + 1))
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_qwen3_5_mtp_head_logits_match_vllms_computation(qwen3_5, kind):
    _check_head_logits(qwen3_5[kind])


def _check_head_logits(checkpoint, oracle=_oracle_logits):
    """The head over one prefill step's positions (the target's hidden states paired with the
    next tokens, the last one with a given token) against the oracle."""
    path = checkpoint[0]
    cfg = load_config(str(path))
    params = load_hf_checkpoint(path, cfg, dtype=np.float32)
    spec, mtp_params = load_mtp(str(path), path, 2, cfg, jnp.float32)
    runner = make_runner(cfg, params)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 23).tolist()
    inputs = builder(runner).build([row(prompt[:-1], 0, 0)], Bucket(len(prompt) - 1, 1, 0))
    target = Mamba2HybridLM(cfg, jnp.float32)
    meta = build_metadata(target, runner.cache_spec, inputs, 0)
    from jaxmamba.model.cache import init_cache
    from jaxmamba.model.mtp import advance_mtp, init_mtp_state

    hidden, _ = target.apply({"params": params}, inputs.input_ids,
                             init_cache(cfg, runner.cache_spec, jnp.float32), meta)  # fmt: skip
    next_ids = jnp.asarray(prompt[1:] + [0] * (inputs.input_ids.shape[0] - len(prompt) + 1))
    kv, last = init_mtp_state(spec, runner.cache_spec)
    g, _ = spec.model.apply({"params": mtp_params},
                            params["embed"]["embedding"][next_ids], hidden, kv, meta)  # fmt: skip
    ours = np.asarray(target.apply({"params": params}, g, method="logits"))[: len(prompt) - 1]
    ref = oracle(checkpoint, prompt)
    scale = max(1.0, float(np.abs(ref).max()))
    assert float(np.abs(ours - ref).max()) <= 1e-4 * scale
    # `advance_mtp` keeps the row's output at its last position for its first draft.
    _, last = advance_mtp(spec, mtp_params, params, kv, last, hidden, next_ids, meta,
                          inputs.state_slots, meta.last_token_index)  # fmt: skip
    np.testing.assert_allclose(np.asarray(last[0]), np.asarray(g[len(prompt) - 2]), rtol=1e-6)


# Nemotron-H: Mamba, attention, MoE and MLP layers; the MTP layer's blocks from
# `mtp_hybrid_override_pattern` ("*E" as NVIDIA publishes it: attention, then MoE).
NEMOTRON_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                    moe_shared_expert_intermediate_size=32, n_group=2, topk_group=1,
                    routed_scaling_factor=2.5)  # fmt: skip


def _nemotron_h_with_mtp(path, pattern: str, seed: int):
    """A random Nemotron-H checkpoint with an MTP layer under NVIDIA's and vLLM's names: the
    blocks of `pattern` as `mtp.layers.{i}.{norm,mixer.*}` (from a NemotronHForCausalLM of
    those blocks, saved alike), `enorm`, `hnorm` and `eh_proj` in the first block,
    `final_layernorm` in the last; config `num_nextn_predict_layers` and
    `mtp_hybrid_override_pattern`. Returns (path, target, layer model, tensors)."""
    path, model = make_nemotron_h_checkpoint(path / "target", pattern="M*E-M", seed=seed,
                                             **NEMOTRON_MOE)  # fmt: skip
    _, layer_model = make_nemotron_h_checkpoint(path / "mtp_layer", pattern=pattern,
                                                seed=seed + 1, **NEMOTRON_MOE)  # fmt: skip
    tensors = load_file(path / "model.safetensors")
    for name, x in load_file(path / "mtp_layer" / "model.safetensors").items():
        if name.startswith("backbone.layers."):
            tensors["mtp.layers." + name.removeprefix("backbone.layers.")] = x
    rng = np.random.default_rng(seed)
    e = model.config.hidden_size
    for norm in ("0.enorm", "0.hnorm", f"{len(pattern) - 1}.final_layernorm"):
        tensors[f"mtp.layers.{norm}.weight"] = (1 + 0.2 * rng.standard_normal(e)).astype(np.float32)
    tensors["mtp.layers.0.eh_proj.weight"] = (rng.standard_normal((e, 2 * e))
                                              / np.sqrt(2 * e)).astype(np.float32)  # fmt: skip
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.pop("mtp_layers_block_type", None)  # transformers' spelling; NVIDIA's below
    config.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern=pattern)
    (path / "config.json").write_text(json.dumps(config))
    return path, model, layer_model, tensors


def _nemotron_h_oracle_logits(checkpoint, prompt) -> np.ndarray:
    """vLLM's Nemotron-H MTP head (`nemotron_h_mtp.py`) at positions 0..n-2 of `prompt`, in
    float64 (the blocks in float32): the target's final-normed hidden h_t and the embedding of
    token t + 1, each RMS-normed (x̂·w: `enorm`, `hnorm`), concatenated [embedding | hidden],
    `eh_proj`, transformers' blocks (x + mixer(norm(x))) under a causal mask,
    `final_layernorm`, the lm_head."""
    _, model, layer_model, t = checkpoint
    eps = model.config.layer_norm_epsilon

    def rms(x, w):
        x = x.astype(np.float64)
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w.astype(np.float64)

    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0].double().numpy()
    n, last = len(prompt) - 1, len(layer_model.model.layers) - 1
    emb = model.model.embeddings.weight.detach().numpy()[prompt[1:]]
    x = np.concatenate([rms(emb, t["mtp.layers.0.enorm.weight"]),
                        rms(hidden[:n], t["mtp.layers.0.hnorm.weight"])], -1)  # fmt: skip
    x = torch.tensor((x @ t["mtp.layers.0.eh_proj.weight"].astype(np.float64).T)[None],
                     dtype=torch.float32)  # fmt: skip
    layer_model.config._attn_implementation = "eager"
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        for block in layer_model.model.layers:
            x = block(x, attention_mask=mask, position_ids=torch.arange(n)[None])
    g = rms(x[0].double().numpy(), t[f"mtp.layers.{last}.final_layernorm.weight"])
    return g @ t["lm_head.weight"].astype(np.float64).T


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    return _nemotron_h_with_mtp(tmp_path_factory.mktemp("nemotron_h"), "*E", seed=8)


def test_nemotron_h_mtp_head_logits_match_vllms_computation(nemotron_h, tmp_path):
    _check_head_logits(nemotron_h, _nemotron_h_oracle_logits)
    # Blocks in another order, with an MLP.
    _check_head_logits(_nemotron_h_with_mtp(tmp_path, "E-*", seed=10),
                       _nemotron_h_oracle_logits)  # fmt: skip


def test_nemotron_h_mtp_blocks_with_mamba_are_refused_naming_the_field():
    target = load_config("nemotron-h-tiny")
    config = {"model_type": "nemotron_h", "num_nextn_predict_layers": 1}
    assert mtp_layers(config, "m") == 1
    assert mtp_config(target, {**config, "mtp_hybrid_override_pattern": "*-"},
                      "m").layer_types == ("attention", "mlp")  # fmt: skip
    with pytest.raises(ValueError, match=r"m: HF config mtp_hybrid_override_pattern='\*M' has "
                                         "a Mamba block"):  # fmt: skip
        mtp_config(target, {**config, "mtp_hybrid_override_pattern": "*M"}, "m")
    with pytest.raises(ValueError, match=r"mtp_layers_block_type=\['mamba'\] has a Mamba"):
        mtp_config(target, {**config, "mtp_layers_block_type": ["mamba"]}, "m")
    with pytest.raises(ValueError, match="without mtp_hybrid_override_pattern"):
        mtp_config(target, config, "m")


rng = np.random.default_rng(0)
LONG = rng.integers(0, 97, 90).tolist()
PROMPTS = [rng.integers(0, 97, 9).tolist(), LONG]
SHARED = LONG[:70] + rng.integers(0, 97, 12).tolist()  # a prefix-cache hit on LONG's pages


def _engines(path) -> dict:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXMAMBA_SAMPLER_VARIANTS", "0")
        return {"base": LLM(str(path), **ENGINE),
                "mtp": LLM(str(path), speculative_config=MTP, **ENGINE)}  # fmt: skip


def _greedy_runs(llm, max_tokens: int = 24):
    """A batch with chunked prefill and mixed steps, then a prompt hitting its cached prefix."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    first = llm.generate(None, greedy, prompt_token_ids=PROMPTS, use_tqdm=False)
    second = llm.generate(None, greedy, prompt_token_ids=[SHARED], use_tqdm=False)
    assert second[0].num_cached_tokens > 0
    return [o.outputs[0].token_ids for o in first + second]


def test_greedy_output_is_identical_with_mtp_drafts(checkpoint):
    engines = _engines(checkpoint[0])
    llm = engines["mtp"]
    assert _greedy_runs(llm) == _greedy_runs(engines["base"])
    # On XLA:CPU the MTP runner's steps are compiled without the fusion emitters, with which
    # its verify step hung now and then (docs/speculative.md, MTP); other runners keep them.
    assert llm.engine.runner._jit_step is step.jitted_step_without_cpu_fusion_emitters
    assert engines["base"].engine.runner._jit_step is step.jitted_step
    stats = llm.stats()
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0
    # The verify program holds no host callback and no device branch.
    runner = llm.engine.runner
    verify = functools.partial(runner._step_fn, num_decode=2, sampler="full")
    padding = llm.engine.builder.padding(Bucket(2 * 4, 2, 2))
    jaxpr = jax.make_jaxpr(verify)(runner.params, runner.cache, runner.slot_state, padding).jaxpr
    names = primitive_names(jaxpr)
    assert "scan" in names  # the head's chained drafts
    assert not [n for n in names if any(f in n for f in FORBIDDEN)], names
    assert not {"cond", "switch", "while"} & names


def test_greedy_output_is_identical_with_mtp_drafts_on_multimodal_qwen3_5_moe(qwen3_5):
    engines = _engines(qwen3_5["moe"][0])
    assert _greedy_runs(engines["mtp"], 12) == _greedy_runs(engines["base"], 12)
    assert engines["mtp"].stats()["spec_verify_steps"] > 0


def test_greedy_output_is_identical_with_mtp_drafts_on_nemotron_h(nemotron_h):
    engines = _engines(nemotron_h[0])
    assert _greedy_runs(engines["mtp"], 12) == _greedy_runs(engines["base"], 12)
    stats = engines["mtp"].stats()
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0


def test_an_mtp_head_that_agrees_with_the_target_has_its_drafts_accepted(tmp_path):
    """Target and head both predict the lm_head's likeliest constant token at every position
    (`_add_mtp(agree=True)`), so greedy output is that token and every draft is kept."""
    path, _ = make_qwen3_next_checkpoint(tmp_path, seed=2)
    _, tensors = _add_mtp(path, seed=3, agree=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXMAMBA_SAMPLER_VARIANTS", "0")
        llm = LLM(str(path), speculative_config=MTP, **ENGINE)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    out = llm.generate(None, greedy, prompt_token_ids=PROMPTS, use_tqdm=False)
    token = int(np.argmax(tensors["lm_head.weight"][:, 0]))
    assert [o.outputs[0].token_ids for o in out] == [[token] * 16] * 2
    stats = llm.stats()
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["spec_verify_steps"] > 0 and stats["steps"] < 16


def test_mtp_is_refused_naming_a_model_without_mtp_layers(tmp_path):
    path, _ = make_qwen3_next_checkpoint(tmp_path / "plain", layer_types=GDN_LAYERS, seed=4)
    with pytest.raises(ValueError, match=r"has no MTP layers \(num_nextn_predict_layers=0\)"):
        LLM(str(path), speculative_config=MTP, **ENGINE)
    with pytest.raises(ValueError, match=r"nemotron-h-tiny is not an HF checkpoint"):
        LLM("nemotron-h-tiny", speculative_config=MTP, **ENGINE)
    with pytest.raises(ValueError, match="method 'mtp' drafts with the target's own"):
        SpeculativeConfig(method="mtp", model="nemotron-h-tiny")


def test_mtp_layers_of_an_unsupported_family_are_refused_by_name():
    with pytest.raises(ValueError, match=r"m \(model_type 'falcon_h1'\) has no MTP layers"):
        mtp_layers({"model_type": "falcon_h1", "num_nextn_predict_layers": 1}, "m")
    with pytest.raises(ValueError, match="num_nextn_predict_layers=2; one MTP layer runs"):
        mtp_layers({"model_type": "qwen3_next", "num_nextn_predict_layers": 2}, "m")
    text = {"model_type": "qwen3_5_moe_text", "mtp_num_hidden_layers": 1}
    assert mtp_layers({"model_type": "qwen3_5_moe", "text_config": text}, "m") == 1
    with pytest.raises(ValueError, match=r"m has no MTP layers \(mtp_num_hidden_layers=0\)"):
        mtp_layers({"model_type": "qwen3_5_text"}, "m")
    with pytest.raises(ValueError, match="mtp_use_dedicated_embeddings=true"):
        mtp_layers({"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1,
                    "mtp_use_dedicated_embeddings": True}, "m")  # fmt: skip
