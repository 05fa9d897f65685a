"""Nemotron-H with MoE layers (`E`, Nemotron 3 Nano) against transformers' NemotronHForCausalLM:
random weights and router correction biases, group-limited routing; fp32 (bf16 once)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from family_checks import (
    check_bf16_prefill_logits,
    check_generation,
    check_prefill_logits,
)

from jaxmamba.model.families import load_config
from jaxmamba.model.moe import route_sigmoid_grouped

from hf_fixtures import save_random_checkpoint

TYPES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def make_nemotron_moe(path, *, pattern, seed, **kw):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    defaults = dict(
        vocab_size=97, hidden_size=32, layers_block_type=[TYPES[c] for c in pattern],
        mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return save_random_checkpoint(
        NemotronHForCausalLM(NemotronHConfig(**{**defaults, **kw})), path, seed
    )


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    return make_nemotron_moe(tmp_path_factory.mktemp("n1"), pattern="ME*E", seed=0)


@pytest.fixture(scope="module")
def ungrouped(tmp_path_factory):
    return make_nemotron_moe(
        tmp_path_factory.mktemp("n2"), pattern="EM-*M", seed=1, n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, mamba_num_heads=6, n_groups=3,
        num_experts_per_tok=3, mlp_bias=True,
    )  # fmt: skip


def test_config_reads_the_router(grouped):
    cfg = load_config(str(grouped[0]))
    assert cfg.layer_types == ("mamba", "moe", "attention", "moe")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_router) == (8, 2, "sigmoid_grouped")
    assert (cfg.moe_num_groups, cfg.moe_topk_groups, cfg.moe_routed_scaling) == (4, 2, 2.5)
    assert cfg.moe_norm_topk_prob and cfg.moe_shared_intermediate_size == 40


def test_router_matches_hf_topk_router(grouped):
    _, model = grouped
    gate = model.model.layers[1].mixer.gate
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, hf_w, hf_idx = gate(x)
    w, idx = route_sigmoid_grouped(
        jnp.asarray(x.numpy() @ gate.weight.detach().numpy().T),
        jnp.asarray(gate.e_score_correction_bias.numpy()), 2, 4, 2, True, 2.5,
    )  # fmt: skip
    order = np.argsort(hf_idx.numpy(), -1)
    ours = np.argsort(np.asarray(idx), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), ours, -1),
                                  np.take_along_axis(hf_idx.numpy(), order, -1))  # fmt: skip
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), ours, -1),
                               np.take_along_axis(hf_w.numpy(), order, -1), rtol=1e-5)  # fmt: skip


def test_prefill_logits_match_hf(grouped, ungrouped):
    check_prefill_logits(*grouped)
    check_prefill_logits(*ungrouped, seed=1)


def test_bf16_prefill_logits_match_hf_bf16(ungrouped):
    check_bf16_prefill_logits(*ungrouped)


def test_generation_chunked_prefill_and_prefix_hit_match_hf_generate(grouped):
    check_generation(*grouped)


def test_moe_step_compiles_once_for_any_routing(grouped):
    from jaxmamba.model.moe import MoE

    cfg = load_config(str(grouped[0]))
    moe = MoE(cfg)
    x = jax.random.normal(jax.random.PRNGKey(0), (13, cfg.hidden_size))
    variables = moe.init(jax.random.PRNGKey(1), x)
    apply = jax.jit(moe.apply)
    # Different tokens route to different experts.
    xs = [jax.random.normal(jax.random.PRNGKey(10 + key), x.shape) for key in range(3)]
    apply(variables, x)
    with jax.transfer_guard("disallow"):
        outs = [apply(variables, xk) for xk in xs]
    assert apply._cache_size() == 1
    assert all(bool(jnp.isfinite(o).all()) for o in outs)


@pytest.mark.parametrize("activation, width", [("relu2", 24), ("silu_glu", 48)])
def test_gathered_blocked_kernel_and_ragged_expert_matmuls_agree(activation, width):
    from jaxmamba.model.moe import blocked_experts, gathered_experts, grouped_experts

    X, k, E, F, T = 8, 2, 16, 24, 11
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(keys[0], (T, E))
    w_up = jax.random.normal(keys[1], (X, E, width)) / 4
    w_down = jax.random.normal(keys[2], (X, F, E)) / 5
    weights = jax.random.uniform(keys[3], (T, k))
    idx = jax.lax.top_k(jax.random.normal(keys[4], (T, X)), k)[1]
    assert T * k > X  # more assignments than experts: the layouts have several per expert
    args = (x, weights, idx, w_up, w_down, activation, jnp.float32)
    ragged = grouped_experts(*args, method="ragged")
    gathered = gathered_experts(*args)
    np.testing.assert_allclose(np.asarray(gathered), np.asarray(ragged), rtol=2e-5, atol=2e-5)
    for block in (1, 4, 16):  # blocks smaller and larger than the groups
        blocked = blocked_experts(*args, block=block)
        np.testing.assert_allclose(np.asarray(blocked), np.asarray(ragged), rtol=2e-5, atol=2e-5)
    kernel = blocked_experts(*args, impl="interpret")  # the Pallas kernel, 16-row blocks
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(ragged), rtol=2e-5, atol=2e-5)
    one = (x[:1], weights[:1], idx[:1], *args[3:])  # 2 assignments of 8 experts: a block each
    want = np.asarray(gathered_experts(*one))
    got = np.asarray(blocked_experts(*one, impl="interpret"))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # A plain loop over tokens and their experts.
    act = (lambda h: np.square(np.maximum(h, 0))) if activation == "relu2" else (
        lambda h: h[:F] / (1 + np.exp(-h[:F])) * h[F:]
    )  # fmt: skip
    xn, un, dn, wn, ix = map(np.asarray, (x, w_up, w_down, weights, idx))
    ref = np.stack([sum(wn[t, j] * (act(xn[t] @ un[ix[t, j]]) @ dn[ix[t, j]])
                        for j in range(k)) for t in range(T)])  # fmt: skip
    np.testing.assert_allclose(np.asarray(ragged), ref, rtol=1e-4, atol=1e-4)
