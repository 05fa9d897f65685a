"""Orbax checkpoints: `jaxmamba convert` of a random HF checkpoint restores bit for bit (the
HF tensors' values, read with safetensors, are exactly the restored ones), `LLM(converted)`
generates what `LLM(hf)` does, and missing, extra or mis-shaped tensors are named. Quantized:
an FP8 (ModelOpt) checkpoint converts as published and `convert --quantization fp8` as
`quantization="fp8"` loads; both restore the params `load_params` gives bit for bit, with no
setting, and refuse another method."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file as save_torch

from jaxmamba import LLM, SamplingParams
from jaxmamba.cli import main
from jaxmamba.model.families import load_config
from jaxmamba.model.orbax_io import (
    ORBAX_SUBDIR,
    checkpoint_specs,
    flat_specs,
    load_orbax_model,
    restore_params,
    save_params,
)
from jaxmamba.model.weights import load_params

from hf_fixtures import make_nemotron_h_checkpoint

ENGINE = dict(max_num_seqs=1, max_model_len=32, max_num_batched_tokens=8, max_prefill_seqs=1,
              compilation_cache=False)  # fmt: skip


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax")
    hf, _ = make_nemotron_h_checkpoint(root / "hf", with_tokenizer=True)
    assert main(["convert", "--from", str(hf), "--to", str(root / "ckpt")]) == 0
    return hf, root / "ckpt"


def _sorted_values(arrays) -> np.ndarray:
    return np.sort(np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays]))


def test_restore_equals_the_hf_weights_bit_for_bit(converted):
    hf, ckpt = converted
    restored = restore_params(ckpt / ORBAX_SUBDIR)
    tensors = {}
    for f in sorted(hf.glob("*.safetensors")):
        tensors.update(load_file(f))
    ours = jax.tree.leaves(restored)
    # Layout-free: the engine transposes and regroups tensors, but every value is the HF
    # checkpoint's, and no more (a tied or derived tensor would add or change values).
    assert sum(a.size for a in ours) == sum(t.size for t in tensors.values())
    a, b = _sorted_values(ours), _sorted_values(tensors.values())
    assert a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_llm_of_the_converted_checkpoint_generates_as_the_hf_one(converted):
    hf, ckpt = converted
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [[5, 17, 33, 2, 9, 41, 60]]
    ours = LLM(str(ckpt), **ENGINE).generate(prompt_token_ids=prompts, sampling_params=sp)
    ref = LLM(str(hf), **ENGINE).generate(prompt_token_ids=prompts, sampling_params=sp)
    assert ours[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert ours[0].outputs[0].cumulative_logprob == ref[0].outputs[0].cumulative_logprob


def test_missing_extra_and_misshaped_tensors_are_named(converted):
    _, ckpt = converted
    found = checkpoint_specs(ckpt / ORBAX_SUBDIR)
    names = sorted(found)
    expected = dict(found)
    dropped = expected.pop(names[0])
    expected["lm_head/extra"] = ((3,), "float32")
    shape, dtype = expected[names[1]]
    expected[names[1]] = ((shape[0] + 1, *shape[1:]), dtype)
    with pytest.raises(ValueError) as err:
        restore_params(ckpt / ORBAX_SUBDIR, expected)
    message = str(err.value)
    assert "missing tensors ['lm_head/extra']" in message
    assert f"unexpected tensors [{names[0]!r}]" in message and dropped
    assert f"{names[1]}: {shape} {dtype}, expected ({shape[0] + 1}," in message
    # A model config the weights were not made for: every tensor that differs is named.
    cfg = load_config(str(ckpt))
    wider = dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size + 8)
    with pytest.raises(ValueError, match=r"mis-shaped tensors \[.*up_proj.*\]"):
        load_orbax_model(ckpt, wider, np.float32)
    assert set(flat_specs(restore_params(ckpt / ORBAX_SUBDIR))) == set(found)


# ----------------------------------------------------------------------------------------
# quantized weights


def _modelopt_fp8(hf, dst):
    """`hf` as ModelOpt's FP8 export writes it (hf_quant_config.json form): every projection
    but layer 0's in float8_e4m3fn with a per-tensor weight scale and a static input scale,
    KV-cache scales on the attention layer."""
    out = {}
    for name, w in load_torch(str(hf / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if not re.search(r"proj\.weight$", name) or module.startswith("backbone.layers.0."):
            out[name] = w
            continue
        scale = w.abs().max() / 448.0
        out[name] = (w / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        out[f"{module}.weight_scale"] = scale.reshape(())
        out[f"{module}.input_scale"] = torch.tensor(0.02)
        if module.endswith(("k_proj", "v_proj")):
            out[f"{module}.{module[-6]}_scale"] = torch.tensor(0.03)
    shutil.copytree(hf, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_torch(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
             "exclude_modules": ["lm_head", "backbone.layers.0.mixer*"]}  # fmt: skip
    (dst / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
    return dst


@pytest.fixture(scope="module")
def quantized(converted, tmp_path_factory):
    """{case: (source, its load_params quantization, converted dir)} for an FP8 checkpoint
    converted as published and a float one converted with `--quantization fp8`."""
    hf, _ = converted
    root = tmp_path_factory.mktemp("quantized")
    fp8 = _modelopt_fp8(hf, root / "fp8")
    assert main(["convert", "--from", str(fp8), "--to", str(root / "fp8-ckpt")]) == 0
    assert main(["convert", "--from", str(hf), "--to", str(root / "q-ckpt"),
                 "--quantization", "fp8"]) == 0  # fmt: skip
    return {"checkpoint": (fp8, None, root / "fp8-ckpt"), "converted": (hf, "fp8", root / "q-ckpt")}


def _assert_bit_identical(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


@pytest.mark.parametrize("case", ["checkpoint", "converted"])
def test_quantized_conversion_restores_what_load_params_gives(quantized, case):
    src, quantization, ckpt = quantized[case]
    cfg = load_config(str(src))
    ours = load_params(str(ckpt), cfg, np.float32, 0)  # no setting: the directory says
    _assert_bit_identical(ours, load_params(str(src), cfg, np.float32, 0, quantization))
    attention = ours["layers_3"]["mixer"]
    assert np.dtype(attention["q_proj"]["weight"].dtype) == np.dtype("float8_e4m3fn")
    if case == "checkpoint":  # layer 0 as excluded; the static and KV-cache scales came along
        assert np.dtype(ours["layers_0"]["mixer"]["in_proj"]["kernel"].dtype) == np.float32
        assert float(attention["k_cache_scale"]) == np.float32(0.03)
        assert float(attention["q_proj"]["input_scale"]) == np.float32(0.02)


@pytest.mark.parametrize("case", ["checkpoint", "converted"])
def test_llm_of_a_quantized_conversion_generates_as_its_source(quantized, case):
    src, quantization, ckpt = quantized[case]
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 9, 41, 60]]
    # The suite's compilation cache: the second engine's steps are the first's programs.
    engine = dict(ENGINE, compilation_cache=True)
    ours = LLM(str(ckpt), **engine).generate(prompt_token_ids=prompts, sampling_params=sp)
    ref = LLM(str(src), quantization=quantization, **engine).generate(
        prompt_token_ids=prompts, sampling_params=sp
    )
    assert ours[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_another_quantization_of_a_quantized_conversion_is_refused(quantized):
    for case in ("checkpoint", "converted"):
        _, _, ckpt = quantized[case]
        with pytest.raises(ValueError, match=r"quantization='int8' cannot apply .*'fp8'"):
            LLM(str(ckpt), quantization="int8", **ENGINE)
    config = json.loads((quantized["converted"][2] / "config.json").read_text())
    assert config["jaxmamba_quantization"] == "fp8"


@pytest.mark.parametrize("case", ["checkpoint", "converted"])
def test_missing_and_misshaped_quantized_tensors_are_named(quantized, case, tmp_path):
    src, _, ckpt = quantized[case]
    cfg = load_config(str(src))
    params = restore_params(ckpt / ORBAX_SUBDIR)
    attention = params["layers_3"]["mixer"]
    del attention["q_proj"]["weight_scale"]
    attention["o_proj"]["weight_scale"] = np.ones((2, 3), np.float32)
    shutil.copytree(ckpt, tmp_path / "bad", ignore=shutil.ignore_patterns(ORBAX_SUBDIR))
    save_params(tmp_path / "bad" / ORBAX_SUBDIR, params)
    with pytest.raises(ValueError) as err:
        load_orbax_model(tmp_path / "bad", cfg, np.float32)
    message = str(err.value)
    assert "missing tensors ['layers_3/mixer/q_proj/weight_scale']" in message
    assert "layers_3/mixer/o_proj/weight_scale: (2, 3) float32, expected (" in message
