"""Quantized weights and the FP8 KV cache (docs/quantization.md).

FP8 checkpoints are written here from random float HF models, as NVIDIA ModelOpt (per-tensor
`weight_scale`, static `input_scale`) and Qwen (128x128 blocks of `weight_scale_inv`) publish
them, and checked against transformers running the same weights dequantized in float32 —
with, for ModelOpt's static activation scales, every quantized Linear's input rounded to FP8
as an FP8 GEMM rounds it. `quantization="fp8"`/`"int8"` and FP8 pages are checked for staying
close to the float model; unsupported schemes for being refused by name.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from family_checks import assert_logits_close, hf_logits
from safetensors.torch import load_file, save_file

from jaxmamba import LLM, SamplingParams
from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder
from jaxmamba.engine.config import EngineConfig
from jaxmamba.engine.runner import ModelRunner
from jaxmamba.kernels.matmul import QuantizedWeight, scaled_matmul
from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.families import load_config
from jaxmamba.model.loader import load_hf_checkpoint
from jaxmamba.model.moe import grouped_experts
from jaxmamba.model.params import init_params, param_shapes
from jaxmamba.model.quantization import quantize_params, read_quantization
from jaxmamba.model.weights import load_params

from hf_fixtures import make_qwen3_5_checkpoint, save_random_checkpoint
from model_helpers import builder, make_runner, prefill_logits, random_prompts, row

E4M3 = torch.float8_e4m3fn
E4M3_JAX = jnp.float8_e4m3fn
FP8_MAX = 448.0
# The Linear weights a quantizer converts: every `*proj*` matrix (experts' included); routers
# (`gate`), the shared-expert gate, embeddings, norms, the conv and the lm_head are not.
PROJECTION = re.compile(r"proj(_\w+)?\.weight$")


def to_fp8(x: torch.Tensor, scale) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def round_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 GEMM with a static activation scale sees of `x`."""
    return to_fp8(x, scale).float() * scale


def write_checkpoint(src: Path, dst: Path, tensors: dict, quant_config: dict | None,
                     hf_quant_config: dict | None = None) -> Path:  # fmt: skip
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config))
    if hf_quant_config is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant_config))
    return dst


# ----------------------------------------------------------------------------------------
# ModelOpt FP8: Nemotron-H with Mamba2, attention, MLP and MoE layers


class _Rounded(torch.nn.Module):
    """An activation module whose output is rounded to FP8 (the experts' down-proj input)."""

    def __init__(self, act, scale: float):
        super().__init__()
        self.act, self.scale = act, scale

    def forward(self, x):
        return round_fp8(self.act(x), self.scale)


@torch.no_grad()
def input_amax(model, prompt: list[int]) -> dict[str, float]:
    """Each Linear's (and each expert stack's up/down) largest input on `prompt`, by HF
    in-memory module name: ModelOpt's max calibration."""
    amax: dict[str, float] = {}

    def record(name):
        return lambda _, args: amax.__setitem__(
            name, max(amax.get(name, 0.0), float(args[0].abs().max()))
        )

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)]  # fmt: skip
    for name, m in model.named_modules():
        if name.endswith(".experts"):
            hooks.append(m.register_forward_pre_hook(record(f"{name}.up_proj")))
            act = m.act_fn
            m.act_fn = _Recorder(act, lambda x, n=f"{name}.down_proj": record(n)(None, (x,)))
    model(torch.tensor([prompt]), use_cache=False)
    for h in hooks:
        h.remove()
    for name, m in model.named_modules():
        if name.endswith(".experts"):
            m.act_fn = m.act_fn.act
    return amax


class _Recorder(torch.nn.Module):
    def __init__(self, act, callback):
        super().__init__()
        self.act, self.callback = act, callback

    def forward(self, x):
        y = self.act(x)
        self.callback(y)
        return y


def modelopt_tensors(state: dict, amax: dict[str, float], excluded: tuple[str, ...]):
    """`state` quantized as ModelOpt's FP8 export writes it: per-tensor weight scales, a
    static input scale per Linear (calibrated max x 1.2; the experts' differ per expert), KV
    scales on every attention layer; `excluded` (ModelOpt wildcards) left as they are."""
    out = {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if not PROJECTION.search(name) or any(fnmatch.fnmatch(module, p) for p in excluded):
            out[name] = w
            continue
        s = w.abs().max() / FP8_MAX
        out[name], out[f"{module}.weight_scale"] = to_fp8(w, s), s.reshape(())
        memory = re.sub(r"^backbone\.", "model.", module)
        expert = re.search(r"\.experts\.(\d+)\.", memory)
        if expert:
            memory = re.sub(r"\.experts\.\d+\.", ".experts.", memory)
        factor = 1.2 * (1 + 0.1 * int(expert.group(1)) if expert else 1)
        out[f"{module}.input_scale"] = torch.tensor(amax[memory] * factor / FP8_MAX)
        if module.endswith(("k_proj", "v_proj")):
            which = module[-6]
            out[f"{module}.{which}_scale"] = torch.tensor(0.02 + 0.01 * (which == "v"))
    return out


def dequantized(tensors: dict) -> dict:
    """The float32 weights an FP8 checkpoint stands for (its scales dropped)."""
    out = {}
    for name, w in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if w.dtype != E4M3:
            out[name] = w
            continue
        module = name.removesuffix(".weight")
        s = tensors.get(f"{module}.weight_scale")
        if s is None:  # 128x128 blocks
            s = tensors[f"{module}.weight_scale_inv"]
            s = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        out[name] = w.float() * s
    return out


@torch.no_grad()
def fp8_gemm_reference(path: Path, tensors: dict):
    """transformers' model of `path` holding `tensors` dequantized, every quantized Linear's
    (and expert stack's) input rounded to FP8 at its static scale — the largest of its
    experts' (vLLM's choice)."""
    from transformers import AutoModelForCausalLM

    ref_dir = write_checkpoint(path, path.parent / f"{path.name}-ref", dequantized(tensors), None)
    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    scales: dict[str, float] = {}
    for name, s in tensors.items():
        if name.endswith(".input_scale"):
            memory = re.sub(r"\.experts\.\d+\.", ".experts.", name.replace("backbone.", "model."))
            key = memory.removesuffix(".input_scale")
            scales[key] = max(scales.get(key, 0.0), float(s))
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name in scales:
            m.register_forward_pre_hook(
                lambda _, args, s=scales[name]: (round_fp8(args[0], s), *args[1:])
            )
        if name.endswith(".experts") and f"{name}.up_proj" in scales:
            m.register_forward_pre_hook(
                lambda _, args, s=scales[f"{name}.up_proj"]: (round_fp8(args[0], s), *args[1:])
            )
            m.act_fn = _Rounded(m.act_fn, scales[f"{name}.down_proj"])
    return model


NEMOTRON = dict(
    vocab_size=97, hidden_size=48, mamba_num_heads=6, mamba_head_dim=8, n_groups=2,
    ssm_state_size=8, chunk_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
    intermediate_size=64, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=40, n_group=1, topk_group=1, bos_token_id=1,
    eos_token_id=2, pad_token_id=0,
)  # fmt: skip
MODELOPT_EXCLUDED = ("lm_head", "backbone.layers.0.mixer*")


@pytest.fixture(scope="module")
def modelopt(tmp_path_factory):
    """(ModelOpt FP8 checkpoint in hf_quant_config.json's form, its tensors, the float model)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    types = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    config = NemotronHConfig(**NEMOTRON, layers_block_type=[types[c] for c in "M*-EM"])
    root = tmp_path_factory.mktemp("modelopt")
    src, model = save_random_checkpoint(NemotronHForCausalLM(config), root / "float", seed=0)
    amax = input_amax(model, random_prompts(np.random.default_rng(9), [24], 97)[0])
    tensors = modelopt_tensors(load_file(str(src / "model.safetensors")), amax, MODELOPT_EXCLUDED)
    hf_quant = {"producer": {"name": "modelopt"},
                "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                 "exclude_modules": list(MODELOPT_EXCLUDED)}}  # fmt: skip
    path = write_checkpoint(src, root / "fp8", tensors, None, hf_quant)
    return path, tensors, model


def test_modelopt_fp8_checkpoint_loads_as_published(modelopt):
    path, tensors, _ = modelopt
    cfg = load_config(str(path))
    params = load_hf_checkpoint(path, cfg, dtype=jnp.float32, expected=param_shapes(cfg))
    # Excluded (layer 0's mixer, the lm_head) and never-quantized arrays stay float.
    assert params["layers_0"]["mixer"]["in_proj"]["kernel"].dtype == jnp.float32
    assert params["lm_head"]["kernel"].dtype == jnp.float32
    assert params["layers_3"]["mixer"]["router"].dtype == jnp.float32
    # Quantized ones keep the published [out, in] FP8 bytes and scales.
    attn = params["layers_1"]["mixer"]
    q = attn["q_proj"]
    np.testing.assert_array_equal(
        np.asarray(q["weight"]).view(np.uint8),
        tensors["backbone.layers.1.mixer.q_proj.weight"].view(torch.uint8).numpy(),
    )
    assert q["weight_scale"].shape == (1, 1) and q["input_scale"].shape == ()
    assert float(attn["k_cache_scale"]) == pytest.approx(0.02)
    assert float(attn["v_cache_scale"]) == pytest.approx(0.03)
    moe = params["layers_3"]["mixer"]
    assert moe["experts_up_weight"].shape == (6, 24, 48)  # [X, F, E]: HF's per-expert layout
    assert moe["experts_up_weight_scale"].shape == (6, 1, 1)  # one scale per expert
    # One activation feeds all experts: the largest of their input scales (vLLM's choice).
    ups = [float(tensors[f"backbone.layers.3.mixer.experts.{j}.up_proj.input_scale"])
           for j in range(6)]  # fmt: skip
    assert float(moe["experts_up_input_scale"]) == pytest.approx(max(ups))


def test_modelopt_fp8_logits_match_an_fp8_gemm_reference(modelopt):
    """The engine (float32 compute) against transformers with the dequantized weights and
    each quantized Linear's input rounded to FP8 at its static scale: what remains is float32
    summation order, and the rare activation that float32 noise rounds to the other FP8
    neighbour (one FP8 step, 1/8 of the value, in one element of one layer) — a few 1e-3 of
    the logits' range at most, where a wrong scale or layout errs by tens of percent."""
    path, tensors, _ = modelopt
    cfg = load_config(str(path))
    runner = make_runner(cfg, load_hf_checkpoint(path, cfg, dtype=jnp.float32))
    prompts = random_prompts(np.random.default_rng(0), [13, 21], cfg.vocab_size)
    ours = prefill_logits(runner, [row(p, 0, slot) for slot, p in enumerate(prompts)], 40)
    reference = fp8_gemm_reference(path, tensors)
    for p, logits in zip(prompts, ours, strict=True):
        assert_logits_close(logits, hf_logits(reference, p), rel=1e-3)


# ----------------------------------------------------------------------------------------
# Block-scaled FP8 (Qwen): Qwen3.5 MoE with every projection wider than one 128-block


def block_tensors(state: dict, excluded: tuple[str, ...]) -> dict:
    """`state` quantized as Qwen's FP8 checkpoints: a `weight_scale_inv` per 128x128 block."""
    out = {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if not PROJECTION.search(name) or any(module.startswith(p) for p in excluded):
            out[name] = w
            continue
        rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
        padded = torch.zeros(rows * 128, cols * 128)
        padded[: w.shape[0], : w.shape[1]] = w
        amax = padded.reshape(rows, 128, cols, 128).abs().amax(dim=(1, 3))
        s = amax / FP8_MAX
        full = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        out[name], out[f"{module}.weight_scale_inv"] = to_fp8(w, full), s
    return out


# Layer 0's GDN in_proj is fused from four HF tensors, one of them left unquantized: it loads
# dequantized. Layer 1's o_proj is excluded outright.
BLOCK_EXCLUDED = ("lm_head", "model.layers.0.linear_attn.in_proj_a",
                  "model.layers.1.self_attn.o_proj", "model.layers.0.mlp.gate",
                  "model.layers.1.mlp.gate")  # fmt: skip


@pytest.fixture(scope="module")
def block_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("block")
    src, _ = make_qwen3_5_checkpoint(
        root / "float", moe=True, hidden_size=160, moe_intermediate_size=144,
        shared_expert_intermediate_size=136, layer_types=("linear_attention", "full_attention",
                                                          "linear_attention"),
    )  # fmt: skip
    tensors = block_tensors(load_file(str(src / "model.safetensors")), BLOCK_EXCLUDED)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128],
             "modules_to_not_convert": list(BLOCK_EXCLUDED)}  # fmt: skip
    return write_checkpoint(src, root / "fp8", tensors, quant), tensors


def test_block_fp8_checkpoint_matches_the_dequantized_model(block_fp8):
    """Block-scaled weights are dequantized inside the step and multiply float activations:
    the engine matches transformers running the dequantized weights to float32 rounding."""
    from transformers import AutoModelForCausalLM

    path, tensors = block_fp8
    cfg = load_config(str(path))
    params = load_hf_checkpoint(path, cfg, dtype=jnp.float32, expected=param_shapes(cfg))
    gdn0, gdn2 = params["layers_0"]["mixer"], params["layers_4"]["mixer"]
    assert gdn0["in_proj"]["kernel"].dtype == jnp.float32  # a part left unquantized
    assert gdn2["in_proj"]["weight"].dtype == jnp.float8_e4m3fn
    assert gdn2["in_proj"]["weight_scale"].shape[-1] == 2  # two 128-blocks of the 160 inputs
    assert params["layers_2"]["mixer"]["o_proj"]["kernel"].dtype == jnp.float32  # excluded
    assert params["layers_3"]["mixer"]["experts_down_weight"].shape == (6, 160, 144)
    runner = make_runner(cfg, params)
    prompts = random_prompts(np.random.default_rng(1), [11, 6], cfg.vocab_size)
    ours = prefill_logits(runner, [row(p, 0, slot) for slot, p in enumerate(prompts)], 20)
    ref_dir = write_checkpoint(path, path.parent / "ref", dequantized(tensors), None)
    reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    for p, logits in zip(prompts, ours, strict=True):
        assert_logits_close(logits, hf_logits(reference, p), rel=1e-4)


# ----------------------------------------------------------------------------------------
# the matmuls themselves


def _weight(rng, n, k, kind, lead=()):
    w = rng.standard_normal((*lead, n, k)).astype(np.float32)
    if kind == "int8":
        s = np.abs(w).max(-1, keepdims=True) / 127
        return QuantizedWeight(jnp.asarray(np.round(w / s).astype(np.int8)), jnp.asarray(s))
    if kind == "block":
        s = rng.uniform(0.01, 0.02, (*lead, -(-n // 128), -(-k // 128))).astype(np.float32)
    else:
        s = rng.uniform(0.01, 0.02, (*lead, n, 1)).astype(np.float32)
    q = jnp.asarray(w * 64).astype(E4M3_JAX)  # |values| up to ~300: normals and subnormals
    return QuantizedWeight(q, jnp.asarray(s), None if kind != "static" else jnp.float32(0.02))


def _real(w: QuantizedWeight) -> np.ndarray:
    """The weight in float64, from the quantized values and scales (numpy)."""
    q = np.asarray(w.weight.astype(jnp.float32), np.float64)
    s = np.asarray(w.scale, np.float64)
    n, k = q.shape[-2:]
    if s.shape[-2] not in (1, n):
        s = np.repeat(s, 128, axis=-2)[..., :n, :]
    return q * np.repeat(s, 128, axis=-1)[..., :k] if s.shape[-1] > 1 else q * s


def _seen(x: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    """The activations as an FP8 GEMM sees them (per token, or the static scale)."""
    if w.weight.dtype != jnp.float8_e4m3fn or w.scale.shape[-1] != 1:
        return x.astype(np.float64)
    s = np.abs(x).max(-1, keepdims=True) / FP8_MAX if w.input_scale is None else w.input_scale
    s = np.asarray(s, np.float32)
    rounded = np.asarray(jnp.clip(jnp.asarray(x / s), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn))
    return rounded.astype(np.float64) * s


@pytest.mark.parametrize("kind", ["per_channel", "static", "block", "int8"])
def test_scaled_matmul_matches_numpy(kind):
    rng = np.random.default_rng(3)
    w = _weight(rng, 200, 300, kind)  # partial blocks on both axes
    x = rng.standard_normal((5, 300)).astype(np.float32)
    got = np.asarray(scaled_matmul(jnp.asarray(x), w, dtype=jnp.float32))
    want = _seen(x, w) @ _real(w).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # one weight per row: the gathered experts of a decode step
    wb = _weight(rng, 40, 300, kind, lead=(5,))
    got = np.asarray(scaled_matmul(jnp.asarray(x), wb, dtype=jnp.float32))
    want = np.einsum("ak,ank->an", _seen(x, wb), _real(wb))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize(
    "method,impl,up_kind",
    [("gathered", "ref", "per_channel"), ("blocked", "ref", "per_channel"),
     ("blocked", "interpret", "per_channel"), ("blocked", "interpret", "static"),
     ("blocked", "interpret", "block")],
)  # fmt: skip
def test_quantized_experts_match_a_loop_over_assignments(method, impl, up_kind):
    """Quantized experts against numpy, on the reference and on the grouped-matmul GPU kernel
    (interpret mode): FP8 x FP8 with per-channel weight scales and per-token or static
    activation scales, a 128-block scale (one block: a scale per expert), int8 converted in
    the kernel."""
    rng = np.random.default_rng(4)
    T, E, F, X, k = 7, 48, 32, 5, 2
    up, down = _weight(rng, 2 * F, E, up_kind, (X,)), _weight(rng, E, F, "int8", (X,))
    x = rng.standard_normal((T, E)).astype(np.float32)
    idx = np.stack([rng.permutation(X)[:k] for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(0.2, 1.0, (T, k)).astype(np.float32)
    args = (jnp.asarray(x), jnp.asarray(weights), jnp.asarray(idx), up, down, "silu_glu",
            jnp.float32, impl, method)  # fmt: skip
    got = grouped_experts(*args)
    jaxpr = jax.make_jaxpr(grouped_experts, static_argnums=(5, 6, 7, 8))(*args)
    assert ("pallas_call" in str(jaxpr)) == (impl == "interpret")
    want = np.zeros((T, E))
    real_up, real_down = _real(up), _real(down)
    for t in range(T):
        for j in range(k):
            e = idx[t, j]
            h = _seen(x[t : t + 1], up.take(e)) @ real_up[e].T
            gate, val = np.split(h, 2, axis=-1)
            h = (gate / (1 + np.exp(-gate)) * val).astype(np.float32)
            want[t] += weights[t, j] * (_seen(h, down.take(e)) @ real_down[e].T)[0]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_scaled_grouped_matmul_kernel_equals_its_reference_and_block_scales_fall_back():
    """`scaled_grouped_matmul` on the kernel (interpret mode) and on the reference's loop give
    the same numbers for per-channel FP8 and int8 (partial tiles along N and K, an unused
    block); 128-block scales along K (KS = 3) run the loop whatever the impl."""
    from jaxmamba.kernels.matmul import scaled_grouped_matmul

    rng = np.random.default_rng(12)
    bm, block_expert = 16, jnp.asarray([2, 0, -1, 3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((4 * bm, 300)), jnp.float32)
    for kind in ("per_channel", "int8", "block"):
        w = _weight(rng, 70, 300, kind, (4,))
        fn = functools.partial(scaled_grouped_matmul, dtype=jnp.float32)
        got = fn(x, w, block_expert, impl="interpret")
        want = fn(x, w, block_expert, impl="ref")
        used = np.repeat(np.asarray(block_expert) >= 0, bm)
        np.testing.assert_allclose(np.asarray(got)[used], np.asarray(want)[used], rtol=1e-5,
                                   atol=1e-5 * float(jnp.abs(want).max()))  # fmt: skip
        jaxpr = str(jax.make_jaxpr(functools.partial(fn, impl="interpret"))(x, w, block_expert))
        assert ("pallas_call" in jaxpr) == (kind != "block"), kind


# ----------------------------------------------------------------------------------------
# quantization at load time, FP8 pages


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _assert_rounded_once(w, q, scale, method: str) -> None:
    """`q · scale` (one scale per output channel, its largest weight at the format's top) is
    `w` [..., N, K] rounded to the nearest FP8 / int8 value."""
    w, scale = np.asarray(w, np.float64), np.asarray(scale, np.float64)
    assert scale.shape == (*w.shape[:-1], 1)
    np.testing.assert_allclose(
        scale[..., 0], np.abs(w).max(-1) / (127 if method == "int8" else FP8_MAX), rtol=1e-6
    )
    err = np.abs(np.asarray(q.astype(jnp.float32), np.float64) * scale - w)
    # half a step: int8's, e4m3's (2^-4 of a normal value, 2^-10 x scale among subnormals)
    bound = scale / 2 if method == "int8" else np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * scale)
    assert np.all(err <= bound * (1 + 1e-6) + 1e-12)


def test_load_time_quantization_rounds_each_projection_weight_once(modelopt):
    """`quantization="fp8"`/`"int8"` on a float model: every projection and expert weight
    (and nothing else) is rounded once to the nearest value of its format, with one scale
    per output channel."""
    float_dir = modelopt[0].parent / "float"
    cfg = load_config(str(float_dir))
    base = load_params(str(float_dir), cfg, jnp.float32, 0)
    for method in ("fp8", "int8"):
        params = quantize_params(base, cfg, method)
        moe, attn = params["layers_3"]["mixer"], params["layers_1"]["mixer"]["q_proj"]
        assert moe["experts_down_weight"].dtype == (jnp.int8 if method == "int8" else E4M3_JAX)
        assert moe["router"].dtype == jnp.float32 and "kernel" in params["lm_head"]
        assert "kernel" in params["layers_0"]["mixer"]["conv1d"]
        float_q = base["layers_1"]["mixer"]["q_proj"]["kernel"]
        float_up = base["layers_3"]["mixer"]["experts_up"]
        _assert_rounded_once(float_q.T, attn["weight"], attn["weight_scale"], method)
        _assert_rounded_once(float_up.swapaxes(1, 2), moe["experts_up_weight"],
                             moe["experts_up_weight_scale"], method)  # fmt: skip


def _demo_bits_per_byte(cfg, params, dtype, tokens, mask, *, fp8_pages=False):
    """Held-out bits per byte of the demo model: each window one prefill row of one step."""
    rows, length = tokens.shape[0], tokens.shape[1] - 1
    pages = length // 16
    spec = CacheSpec(num_slots=rows, num_pages=rows * pages, page_size=16)
    runner = ModelRunner(cfg, params, spec, dtype=dtype)
    if fp8_pages:
        _fp8_pages(runner)
    step = StepBuilder(spec, pages, cfg.vocab_size, cfg.chunk_size).build(
        [RowSpec(tokens[i, :-1].tolist(), 0, i, list(range(i * pages, (i + 1) * pages)))
         for i in range(rows)],
        Bucket(rows * length, rows, 0),
    )  # fmt: skip
    logits = np.asarray(runner.forward_logits(step, 0), np.float32).reshape(rows, length, -1)
    logprobs = _log_softmax(logits)
    nll = -np.take_along_axis(logprobs, tokens[:, 1:, None], -1)[..., 0]
    return float((nll * mask).sum() / mask.sum() / np.log(2)), logprobs


def test_demo_model_bits_per_byte_hold_with_fp8_and_int8():
    """The trained demo model (bf16 weights, bf16 compute) on 1 KB of held-out standard
    library source (`scripts/train_demo.py`'s split): bits per byte within 1 % of bf16 with
    FP8 or int8 weights (`quantization=`), within 2 % with FP8 weights and FP8 pages — the
    issue's bar. (Measured: +0.004 %, -0.07 %, +0.02 %: a trained model's weights and
    activations sit well inside e4m3's range.)"""
    from test_demo_model import DEMO, load_train_demo

    demo = load_train_demo()
    _, held = demo.split_files(demo.source_files(demo.stdlib_dir()))
    tokens, mask = demo.eval_windows(demo.encode_documents(held[:3])[: 2 * 512 + 1], 512)
    cfg = load_config(DEMO)
    base, base_lp = _demo_bits_per_byte(
        cfg, load_params(DEMO, cfg, jnp.bfloat16, 0), jnp.bfloat16, tokens, mask
    )
    for method, pages, bound in (("fp8", False, 0.01), ("int8", False, 0.01), ("fp8", True, 0.02)):
        params = load_params(DEMO, cfg, jnp.bfloat16, 0, method)
        bpb, lp = _demo_bits_per_byte(cfg, params, jnp.bfloat16, tokens, mask, fp8_pages=pages)
        assert abs(bpb - base) <= bound * base, (method, pages, bpb, base)
        kl = (np.exp(base_lp) * (base_lp - lp)).sum(-1)
        assert kl.mean() <= 0.01, (method, pages, kl.mean())


def _fp8_pages(runner):
    cache = runner.cache
    fp8 = lambda pages: tuple(jnp.zeros(p.shape, E4M3_JAX) for p in pages)  # noqa: E731
    runner.cache = cache._replace(k_pages=fp8(cache.k_pages), v_pages=fp8(cache.v_pages))
    return runner


def _greedy(runner, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding below the engine: one prefill, then one decode step per token; the
    tokens and the log-softmax before each."""
    logits = prefill_logits(runner, [row(prompt, 0, 0)])[0][-1]
    tokens, logprobs = [], []
    for i in range(steps):
        logprobs.append(_log_softmax(logits))
        tokens.append(int(np.argmax(logits)))
        if i + 1 < steps:
            step = builder(runner).build([row(tokens[-1:], len(prompt) + len(tokens) - 1, 0)],
                                         Bucket(1, 1, 1))  # fmt: skip
            logits = np.asarray(runner.forward_logits(step, 1))[0]
    return tokens, np.stack(logprobs)


@torch.no_grad()
def _rounded_kv_logprobs(model, ids: list[int], scales: tuple[float, float]) -> np.ndarray:
    """transformers' log-softmax over `ids` with every key and value rounded to FP8 at
    `scales` as the pages store them (Nemotron-H has no RoPE: a page holds k_proj's output)."""
    hooks = []
    for name, m in model.named_modules():
        if name.endswith(("k_proj", "v_proj")):
            s = scales[name.endswith("v_proj")]
            hooks.append(m.register_forward_hook(lambda _, __, out, s=s: round_fp8(out, s)))
    try:
        return _log_softmax(hf_logits(model, ids))
    finally:
        for h in hooks:
            h.remove()


def test_fp8_kv_cache_decodes_what_rounded_keys_and_values_give(modelopt):
    """FP8 pages hold K/s_k and V/s_v rounded to e4m3: greedy decoding (prefill, then decode
    steps reading the pages) matches transformers with its keys and values rounded alike to
    float32 rounding, with vLLM's default scales of 1 (a prefill, which reads the pages it
    writes) and with a checkpoint's (a prefill and decode steps); and stays
    close to the float model (e4m3 keeps 3 mantissa bits: ~3 % noise on each score and
    output, a few hundredths of a nat on this random model)."""
    _, _, model = modelopt
    float_dir = modelopt[0].parent / "float"
    cfg = load_config(str(float_dir))
    params = load_hf_checkpoint(float_dir, cfg, dtype=jnp.float32)
    prompt = random_prompts(np.random.default_rng(5), [14], cfg.vocab_size)[0]
    for scales, steps in (((1.0, 1.0), 1), ((0.02, 0.03), 4)):
        p = jax.tree.map(lambda x: x, params)
        if scales != (1.0, 1.0):
            attn = p["layers_1"]["mixer"]
            attn["k_cache_scale"], attn["v_cache_scale"] = map(jnp.float32, scales)
        tokens, logprobs = _greedy(_fp8_pages(make_runner(cfg, p)), prompt, steps)
        ids = prompt + tokens[:-1]
        rounded = _rounded_kv_logprobs(model, ids, scales)[len(prompt) - 1 :]
        np.testing.assert_allclose(logprobs, rounded, atol=2e-4)
        exact = _log_softmax(hf_logits(model, ids))[len(prompt) - 1 :]
        picked = exact[np.arange(len(tokens)), tokens]
        assert np.all(exact.max(-1) - picked <= 0.1), (scales, exact.max(-1) - picked)
        assert np.abs(logprobs - exact).max() <= 0.3, scales


def test_attention_kernels_read_fp8_pages():
    """The paged-attention kernels (GPU and TPU, in interpret mode) and the reference take
    FP8 pages and compute what they compute on the same values upcast (NaN on the pad page,
    which nothing real reads)."""
    from jaxmamba.kernels.attention import paged_attention_ref
    from jaxmamba.kernels.attention.gpu import paged_attention_gpu
    from jaxmamba.kernels.attention.tpu import paged_attention_tpu
    from jaxmamba.model.metadata import ForwardMetadata

    page_size, heads, head_dim = 4, 2, 16
    spec = CacheSpec(num_slots=4, num_pages=16, page_size=page_size)
    rng = np.random.default_rng(8)
    rows = [RowSpec(rng.integers(0, 50, n).tolist(), c, slot, list(range(4 * slot, 4 * slot + 4)))
            for slot, (c, n) in enumerate([(6, 1), (0, 9), (5, 6)])]  # fmt: skip
    inputs = StepBuilder(spec, 4, 50, 8).build(rows, Bucket(20, 3, 1))
    meta = ForwardMetadata.build(inputs, num_decode=1, chunk_size=8, page_size=page_size,
                                 pad_page=spec.pad_page, pad_slot=spec.pad_slot)  # fmt: skip
    shape = (spec.num_pages + 1, page_size, heads, head_dim)
    pages = [jnp.asarray(rng.standard_normal(shape) * 4, E4M3_JAX).at[spec.pad_page].set(jnp.nan)
             for _ in range(2)]  # fmt: skip
    q = jnp.asarray(rng.standard_normal((20, 2 * heads, head_dim)), jnp.float32)
    args = (meta.page_table, meta.token_rows, meta.positions)
    valid = np.asarray(meta.token_valid)
    want = paged_attention_ref(q, *(p.astype(jnp.float32) for p in pages), *args, scale=0.25)
    for fn in (paged_attention_ref, functools.partial(paged_attention_gpu, interpret=True),
               functools.partial(paged_attention_tpu, interpret=True)):  # fmt: skip
        got = np.asarray(jax.jit(functools.partial(fn, scale=0.25))(q, *pages, *args))
        np.testing.assert_allclose(got[valid], np.asarray(want)[valid], rtol=1e-5, atol=1e-5)


def test_llm_quantization_setting_loads_fp8_weights(modelopt):
    """`LLM(quantization=...)` hands the setting to the loader: the runner holds FP8 weights
    (what they compute is the tests above)."""
    float_dir = modelopt[0].parent / "float"
    llm = LLM(str(float_dir), quantization="fp8", max_num_seqs=1, max_model_len=32,
              max_num_batched_tokens=16, page_size=4, num_pages=9)  # fmt: skip
    mixer = llm.runner.params["layers_1"]["mixer"]
    assert mixer["q_proj"]["weight"].dtype == E4M3_JAX and "kernel" in llm.runner.params["lm_head"]


# ----------------------------------------------------------------------------------------
# refusals


BAD_CONFIGS = [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
     "kv_cache_quant_algo"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "per_token"}, "activation_scheme"),
    ({"quant_method": "fp8", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method"),
]  # fmt: skip


@pytest.mark.parametrize("config,field", BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_unsupported_schemes_are_refused_naming_the_field(tmp_path, config, field):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    with pytest.raises(ValueError, match=rf"\.{field}="):
        read_quantization(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"quant_algo": "FP8_BLOCKWISE"}})
    )
    with pytest.raises(ValueError, match=r"quant_algo='FP8_BLOCKWISE'"):
        read_quantization(tmp_path)


def test_inconsistent_checkpoints_and_settings_are_refused(modelopt, tmp_path):
    path, tensors, _ = modelopt
    cfg = load_config(str(path))
    broken = dict(tensors)
    del broken["backbone.layers.1.mixer.q_proj.weight_scale"]
    shutil.copy(path / "hf_quant_config.json", tmp_path)
    write_checkpoint(path, tmp_path, broken, None)
    with pytest.raises(ValueError, match=r"layers\.1\.mixer\.q_proj\.weight_scale"):
        load_hf_checkpoint(tmp_path, cfg)
    with pytest.raises(ValueError, match="quantization='int8' cannot apply"):
        load_params(str(path), cfg, jnp.float32, 0, "int8")
    with pytest.raises(ValueError, match="quantization='int4'"):
        load_params("nemotron-h-tiny", load_config("nemotron-h-tiny"), jnp.float32, 0, "int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    assert EngineConfig(kv_cache_dtype="fp8").kv_itemsize(2) == 1


# ----------------------------------------------------------------------------------------
# export


EXPORT_ENGINE = dict(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=16,
                     max_prefill_seqs=1, page_size=4, num_state_slots=4, kv_cache_dtype="fp8",
                     compilation_cache=False)  # fmt: skip


def test_exported_fp8_model_with_fp8_pages_serves_the_live_engines_tokens(modelopt, tmp_path):
    """`export_artifact(quantization="fp8")` with `kv_cache_dtype="fp8"`: the artifact holds
    the FP8 weights and scales (Orbax) and FP8 pages, and serves the live engine's greedy
    tokens and logprobs (a chunked prefill, decodes, a prefix-cache hit). Without weights the
    step's parameters are the same shapes (`quantized_param_shapes`)."""
    from jaxmamba.export.writer import export_artifact, param_tree

    float_dir = str(modelopt[0].parent / "float")
    engine = {k: v for k, v in EXPORT_ENGINE.items() if k != "compilation_cache"}
    out = export_artifact(float_dir, tmp_path / "art", engine=engine, quantization="fp8",
                          platforms=["cpu"])  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    dtypes = {t["dtype"] for t in manifest["weights"]["tensors"].values()}
    assert "float8_e4m3fn" in dtypes and manifest["cache"]["kv_dtype"] == "fp8"
    assert "float8_e4m3fn" in {a["dtype"] for a in manifest["state"]["cache"]}
    prompts = random_prompts(np.random.default_rng(6), [19, 3], 97)
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    results = []
    for llm in (LLM(float_dir, quantization="fp8", **EXPORT_ENGINE),
                LLM(str(out), compilation_cache=False)):  # fmt: skip
        runs = [llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
                for _ in range(2)]  # fmt: skip
        results.append([(c.token_ids, [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)],
                         o.num_cached_tokens) for run in runs for o in run
                        for c in [o.outputs[0]]])  # fmt: skip
    live, served = results
    assert [r[0] for r in served] == [r[0] for r in live]
    assert [r[2] for r in served] == [r[2] for r in live] and live[2][2] > 0  # a cache hit
    for (_, a, _), (_, b, _) in zip(served, live, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    cfg = load_config(float_dir)
    shapes = param_tree(float_dir, cfg, jnp.float32, "fp8")
    loaded = param_tree(
        float_dir, cfg, jnp.float32, params=load_params(float_dir, cfg, jnp.float32, 0, "fp8")
    )
    assert jax.tree.structure(shapes) == jax.tree.structure(loaded)
    assert jax.tree.leaves(shapes) == jax.tree.leaves(loaded)


# ----------------------------------------------------------------------------------------
# tensor parallelism of quantized models: a subprocess with 2 virtual CPU devices


def block_quantize(params: dict, cfg) -> dict:
    """`params` with every quantizable weight in 128x128-block-scaled FP8 (Qwen's layout)."""
    from jaxmamba.model.quantization import quantizable_paths, quantized_names

    out = jax.tree.map(lambda x: x, params)
    for path in quantizable_paths(cfg):
        parent = out
        for key in path[:-1]:
            parent = parent[key]
        w = np.swapaxes(np.asarray(parent.pop(path[-1]), np.float32), -1, -2)  # [..., N, K]
        *lead, n, k = w.shape
        nb, kb = -(-n // 128), -(-k // 128)
        padded = np.zeros((*lead, nb * 128, kb * 128), np.float32)
        padded[..., :n, :k] = w
        amax = np.abs(padded.reshape(*lead, nb, 128, kb, 128)).max(axis=(-3, -1))
        s = np.maximum(amax, 1e-12) / FP8_MAX
        full = np.repeat(np.repeat(s, 128, -2), 128, -1)[..., :n, :k]
        names = quantized_names(path[-1])
        parent[names[0]] = jnp.asarray(np.clip(w / full, -FP8_MAX, FP8_MAX)).astype(E4M3_JAX)
        parent[names[1]] = jnp.asarray(s, jnp.float32)
    return out


def dequantize_params(params: dict) -> dict:
    """Float params standing for quantized `params`: each weight times its scales, as the
    float leaf `[..., K, N]` (the reference the quantized model approximates)."""
    from jaxmamba.kernels.matmul.quantized import QuantizedWeight, dequantize
    from jaxmamba.model.quantization import float_name, quantized_names

    if not isinstance(params, dict):
        return params
    out = {}
    for key, value in params.items():
        name = float_name(key)
        if name is not None and not isinstance(value, dict):
            weight, scale, _ = quantized_names(name)
            w = QuantizedWeight(value, params[scale])
            out[name] = jnp.swapaxes(dequantize(w, jnp.float32), -1, -2)
        elif not key.endswith(("weight_scale", "input_scale")):
            out[key] = dequantize_params(value)
    return out


TP_ENGINE = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, page_size=4,
                 compilation_cache=False)  # fmt: skip
TP_TINY_BLOCKS = dict(mamba_head_dim=32, head_dim=64, intermediate_size=256)  # whole blocks


@pytest.fixture(scope="module")
def tp_seen(modelopt, tmp_path_factory) -> dict:
    import os
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("tp_quant") / "seen.json"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    root = Path(__file__).resolve().parents[1]
    paths = [str(root / "tests"), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)  # not the root: tests/conftest.py
    proc = subprocess.run([sys.executable, __file__, str(out), str(modelopt[0])], env=env,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_quantized_tp2_greedy_tokens_equal_tp1(tp_seen):
    """`LLM(..., tensor_parallel_size=2)` against TP 1: the greedy tokens (a chunked prefill,
    then decodes) and their logprobs. `quantization="int8"` and ModelOpt's FP8 checkpoint
    (static activation scales) with FP8 pages quantize the same numbers on every shard:
    float32 rounding apart. `quantization="fp8"` with FP8 pages (the tiny preset): the same
    tokens; the logprobs differ by the FP8 rounding of the row-parallel inputs (below)."""
    for case, tokens in tp_seen["tokens"].items():
        assert tokens["2"] == tokens["1"], (case, tokens)
        atol = 0.02 if case == "fp8_fp8_pages" else 2e-5
        for a, b in zip(tp_seen["logprobs"][case]["2"], tp_seen["logprobs"][case]["1"],
                        strict=True):  # fmt: skip
            np.testing.assert_allclose(a, b, atol=atol, rtol=0)


def test_quantized_tp2_logits_equal_tp1_where_activations_are_not_requantized(tp_seen):
    """TP 2 against TP 1 prefill logits: weight-only int8, block-scaled FP8 (the weight
    dequantized in the step) and ModelOpt's static activation scales quantize exactly as on
    one device — float32 summation order is all that differs."""
    for case in ("int8", "block", "modelopt", "modelopt_fp8_pages"):
        err = tp_seen["logits"][case]["tp2_vs_tp1"]
        assert err <= 1e-5 * tp_seen["logits"][case]["range"], (case, tp_seen["logits"][case])


def test_quantized_fp8_tp2_stays_as_close_to_the_dequantized_model_as_tp1(tp_seen):
    """Dynamic FP8 activations under TP: the shard of a row-parallel projection scales its
    own slice of each token (as vLLM does; one scale for the whole row would cost an
    all-reduce per layer), never more coarsely than the row's scale. So TP 2 rounds other
    numbers, not worse ones: its mean distance to the model with the dequantized weights is
    TP 1's (within 25 %, seen: 2 %), and TP 2 - TP 1 is of FP8-noise size (seen 0.5 % of the
    logits' range on the tiny preset; bound 2 %)."""
    seen = tp_seen["logits"]["fp8_tiny"]
    assert seen["tp2_vs_deq"] <= 1.25 * seen["tp1_vs_deq"], seen
    assert seen["tp2_vs_tp1"] <= 0.02 * seen["range"], seen


def test_quantized_scales_are_sharded_with_their_weights(tp_seen):
    """Each shard's dequantized weights are the whole dequantized weight's shard (rearranged
    as float weights are): per-channel FP8/int8, per-expert and per-tensor ModelOpt scales,
    128-block scales (spread over the rows of a column-parallel weight, split by blocks along
    a row-parallel one)."""
    assert tp_seen["layout_checked"] >= 20, tp_seen["layout_checked"]


def test_block_scales_that_a_shard_would_cut_are_refused(tp_seen):
    assert "not whole 128-column blocks" in tp_seen["refused"], tp_seen["refused"]
    assert "tensor_parallel_size=2" in tp_seen["refused"]


def _tp_layout_checks(cfg, params, mesh) -> int:
    """Compare each shard's dequantized weight with the float weight's shard (sharding.py's
    rearrangement of the dequantized whole); returns how many weights were checked."""
    from jaxmamba.kernels.matmul.quantized import QuantizedWeight, dequantize
    from jaxmamba.model.quantization import quantized_names
    from jaxmamba.parallel import sharding
    from jaxmamba.parallel.plan import TensorParallelPlan

    plan = TensorParallelPlan(cfg, 2)
    sharded = sharding.shard_params(plan, params, mesh)
    reference = sharding.shard_params(plan, dequantize_params(params), mesh)
    checked = 0

    def walk(q, ref, s):
        nonlocal checked
        for key, value in q.items():
            if isinstance(value, dict):
                walk(value, ref[key], s[key])
                continue
            name = key.removesuffix("weight").removesuffix("_") or "kernel"
            if key not in ("weight",) and not key.endswith("_weight"):
                continue
            _, scale, _ = quantized_names(name)
            want = np.asarray(ref[name])
            for shard in range(2):
                w = s[key].addressable_shards[shard].data
                sc = s[scale].addressable_shards[shard].data
                got = np.swapaxes(np.asarray(dequantize(QuantizedWeight(w, sc), jnp.float32)),
                                  -1, -2)  # fmt: skip
                index = ref[name].addressable_shards[shard].index
                np.testing.assert_allclose(got, want[index], rtol=1e-6, atol=1e-7)
            checked += 1

    walk(params, reference, sharded)
    return checked


def _tp_main(out_path: str, modelopt_dir: str) -> None:
    import dataclasses

    from jaxmamba.parallel.sharding import make_mesh

    assert jax.device_count() == 2, jax.devices()
    mesh = make_mesh(2)
    float_dir = str(Path(modelopt_dir).parent / "float")
    cfg = load_config(float_dir)
    base = load_params(float_dir, cfg, jnp.float32, 0)
    rng = np.random.default_rng(11)
    prompts = random_prompts(rng, [21, 6], cfg.vocab_size)
    seen = {"tokens": {}, "logprobs": {}, "logits": {}, "layout_checked": 0}

    def logits(cfg, params, n, kv_dtype="auto"):
        spec = CacheSpec(num_slots=4, num_pages=4 * 16, page_size=4, kv_dtype=kv_dtype)
        runner = ModelRunner(cfg, params, spec, tensor_parallel_size=n)
        rows = [row(p, 0, slot) for slot, p in enumerate(prompts)]
        return np.concatenate(prefill_logits(runner, rows, 32))

    def compare(case, cfg, params, deq=None, kv_dtype="auto"):
        one, two = logits(cfg, params, 1, kv_dtype), logits(cfg, params, 2, kv_dtype)
        entry = {"range": float(one.max() - one.min()),
                 "tp2_vs_tp1": float(np.abs(two - one).max())}  # fmt: skip
        if deq is not None:
            ref = logits(cfg, deq, 1, kv_dtype)
            entry["tp1_vs_deq"] = float(np.abs(one - ref).mean())
            entry["tp2_vs_deq"] = float(np.abs(two - ref).mean())
        seen["logits"][case] = entry

    # `quantization=` on the random Nemotron-H (Mamba, attention, MLP, MoE with a shared
    # expert), through LLM: greedy tokens; then prefill logits through the runner.
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    for case, model, settings in (
        ("int8", float_dir, dict(quantization="int8")),
        ("modelopt_fp8_pages", modelopt_dir, dict(kv_cache_dtype="fp8")),
        ("fp8_fp8_pages", "nemotron-h-tiny", dict(quantization="fp8", kv_cache_dtype="fp8")),
    ):
        seen["tokens"][case], seen["logprobs"][case] = {}, {}
        for n in (1, 2):
            llm = LLM(model, tensor_parallel_size=n, **settings, **TP_ENGINE)
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
            seen["tokens"][case][n] = [o.outputs[0].token_ids for o in outs]
            seen["logprobs"][case][n] = [
                [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
                for c in (o.outputs[0] for o in outs)
            ]
            del llm
    for method in ("int8", "fp8"):
        params = quantize_params(base, cfg, method)
        if method == "int8":  # dynamic FP8: on the tiny preset below (this model's FP8 noise
            compare(method, cfg, params)  # is 0.5-1.6 in the logits)
        seen["layout_checked"] += _tp_layout_checks(cfg, params, mesh)
    tiny = load_config("nemotron-h-tiny")
    tiny_fp8 = quantize_params(init_params(tiny, jnp.float32, 0), tiny, "fp8")
    compare("fp8_tiny", tiny, tiny_fp8, dequantize_params(tiny_fp8))
    # ModelOpt's checkpoint: per-tensor and per-expert scales, static activation scales, KV
    # scales (with FP8 pages).
    mcfg = load_config(modelopt_dir)
    mparams = load_hf_checkpoint(Path(modelopt_dir), mcfg, dtype=jnp.float32)
    compare("modelopt", mcfg, mparams)
    compare("modelopt_fp8_pages", mcfg, mparams, kv_dtype="fp8")
    seen["layout_checked"] += _tp_layout_checks(mcfg, mparams, mesh)
    # 128-block scales: a tiny preset whose row-parallel inputs split into whole blocks, and
    # the plain tiny preset, whose do not (refused).
    bcfg = dataclasses.replace(tiny, **TP_TINY_BLOCKS)
    bparams = block_quantize(init_params(bcfg, jnp.float32, 3), bcfg)
    prompts[:] = random_prompts(rng, [21, 6], bcfg.vocab_size)
    compare("block", bcfg, bparams)
    seen["layout_checked"] += _tp_layout_checks(bcfg, bparams, mesh)
    cut = dataclasses.replace(tiny, intermediate_size=384)  # 192 MLP inputs a shard
    try:
        ModelRunner(
            cut,
            block_quantize(init_params(cut, jnp.float32, 3), cut),
            CacheSpec(num_slots=2, num_pages=8, page_size=4),
            tensor_parallel_size=2,
        )
        seen["refused"] = ""
    except ValueError as e:
        seen["refused"] = str(e)
    Path(out_path).write_text(json.dumps(seen))


if __name__ == "__main__":
    import sys

    _tp_main(*sys.argv[1:])
