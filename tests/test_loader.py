import dataclasses
import json
import re
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from jaxmamba.model.families import config_from_hf, config_from_preset
from jaxmamba.model.loader import (
    checkpoint_param_shapes,
    load_hf_checkpoint,
    save_hf_checkpoint,
)

from hf_fixtures import make_mamba2_checkpoint, make_nemotron_h_checkpoint


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return make_nemotron_h_checkpoint(tmp_path_factory.mktemp("nh") / "ckpt", seed=1)


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory):
    return make_mamba2_checkpoint(
        tmp_path_factory.mktemp("m2") / "ckpt", seed=2, max_shard_size="20KB"
    )


def _flat(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def _assert_trees_equal(a, b):
    fa, fb = dict(_flat(a)), dict(_flat(b))
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype, k
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


def _hf_view(path: str, value: np.ndarray):
    """Our param path -> (HF state_dict name, value in HF layout); written independently of
    the loader's table."""
    name = path.replace("layers_", "layers.").replace("/", ".")
    name = re.sub(r"\.(kernel|scale)$", ".weight", name)
    name = name.replace("embed.embedding", "embeddings.weight")
    if name.endswith("conv1d.weight"):
        value = value.T[:, None, :]
    elif path.endswith("kernel"):
        value = value.T
    return name, value


def _assert_matches_state_dict(params, model, *, base="model.", atol=0.0, dtype=None):
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    seen = set()
    for path, value in _flat(params):
        name, hf_value = _hf_view(path, np.asarray(value, np.float32))
        key = name if name.startswith("lm_head") else base + name
        want = sd[key] if dtype is None else sd[key].astype(dtype).astype(np.float32)
        assert hf_value.shape == want.shape, (path, key)
        np.testing.assert_allclose(hf_value, want, atol=atol, rtol=0, err_msg=f"{path} vs {key}")
        seen.add(key)
    return set(sd) - seen


def test_nemotron_h_loads_every_tensor_transposed_like_torch(nemotron):
    path, model = nemotron
    cfg = config_from_hf(path)
    params = load_hf_checkpoint(
        path, cfg, dtype=jnp.float32, expected=checkpoint_param_shapes(cfg, jnp.float32)
    )
    assert _assert_matches_state_dict(params, model) == set()
    mixer = params["layers_0"]["mixer"]
    assert mixer["in_proj"]["kernel"].shape == (48, cfg.in_proj_dim)
    assert mixer["conv1d"]["kernel"].shape == (4, cfg.conv_dim)
    assert params["layers_3"]["mixer"]["k_proj"]["kernel"].shape == (48, 2 * 12)
    assert params["lm_head"]["kernel"].shape == (48, 97)


def test_sharded_mamba2_loads_and_tied_head_is_omitted(mamba2):
    path, model = mamba2
    assert len(list(path.glob("model-*.safetensors"))) > 1
    assert (
        "lm_head.weight"
        not in json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    )
    params = load_hf_checkpoint(path, dtype=jnp.float32)
    assert "lm_head" not in params
    # lm_head.weight is tied to the embedding in the torch model; nothing else is left over.
    assert _assert_matches_state_dict(params, model, base="backbone.") == {"lm_head.weight"}


def test_sharded_and_unsharded_checkpoints_load_identically(tmp_path):
    a, _ = make_nemotron_h_checkpoint(tmp_path / "one", pattern="M*-M", seed=3)
    b, _ = make_nemotron_h_checkpoint(
        tmp_path / "many", pattern="M*-M", seed=3, max_shard_size="8KB"
    )
    assert (b / "model.safetensors.index.json").is_file() and not (b / "model.safetensors").exists()
    pa, pb = load_hf_checkpoint(a, dtype=jnp.float32), load_hf_checkpoint(b, dtype=jnp.float32)
    _assert_trees_equal(pa, pb)


def test_bf16_conversion_keeps_ssm_scalars_and_norms_in_fp32(nemotron):
    path, model = nemotron
    params = load_hf_checkpoint(path, dtype=jnp.bfloat16)
    for p, v in _flat(params):
        fp32 = p.endswith(("A_log", "D", "dt_bias", "scale"))
        assert v.dtype == (jnp.float32 if fp32 else jnp.bfloat16), p
    # The bf16 values are the float32 checkpoint rounded once.
    got = np.asarray(params["layers_0"]["mixer"]["in_proj"]["kernel"], np.float32)
    want = model.model.layers[0].mixer.in_proj.weight.detach().numpy().T
    np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_bf16_checkpoint_on_disk_is_read(tmp_path, nemotron):
    _, model = nemotron
    bf16 = tmp_path / "bf16"
    shutil.copytree(nemotron[0], bf16)
    sd = {k: v.to(torch.bfloat16) for k, v in load_file(bf16 / "model.safetensors").items()}
    save_file(sd, bf16 / "model.safetensors", metadata={"format": "pt"})
    params = load_hf_checkpoint(bf16, dtype=jnp.float32)
    assert params["norm_f"]["scale"].dtype == jnp.float32
    _assert_matches_state_dict(params, model, dtype=ml_dtypes.bfloat16)


def test_save_then_load_round_trips_and_transformers_reads_the_export(tmp_path, nemotron):
    from transformers import NemotronHForCausalLM

    path, model = nemotron
    cfg = config_from_hf(path)
    params = load_hf_checkpoint(path, cfg, dtype=jnp.float32)
    save_hf_checkpoint(params, cfg, tmp_path / "export")
    again = load_hf_checkpoint(tmp_path / "export", cfg, dtype=jnp.float32)
    _assert_trees_equal(params, again)
    reloaded = NemotronHForCausalLM.from_pretrained(tmp_path / "export")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[k], v, rtol=0, atol=0, msg=k)


def test_mamba2_export_round_trips(tmp_path, mamba2):
    path, _ = mamba2
    params = load_hf_checkpoint(path, dtype=jnp.bfloat16)
    cfg = config_from_hf(path)
    save_hf_checkpoint(params, cfg, tmp_path / "export")
    again = load_hf_checkpoint(tmp_path / "export", cfg, dtype=jnp.bfloat16)
    _assert_trees_equal(params, again)


def test_tied_nemotron_h_accepts_a_head_equal_to_the_embedding(tmp_path):
    path, model = make_nemotron_h_checkpoint(tmp_path / "tied", pattern="M-", tie=True, seed=4)
    params = load_hf_checkpoint(path, dtype=jnp.float32)
    assert "lm_head" not in params
    assert _assert_matches_state_dict(params, model) == {"lm_head.weight"}
    sd = load_file(path / "model.safetensors")
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight different from the embeddings"):
        load_hf_checkpoint(path)


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_other_base_prefixes_and_ignorable_tensors_load(tmp_path, nemotron, prefix):
    src, model = nemotron
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    sd = {re.sub(r"^backbone\.", prefix, k): v for k, v in sd.items()}
    sd["mtp.layers.0.mixer.q_proj.weight"] = torch.randn(3, 3)  # MTP heads are skipped
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    params = load_hf_checkpoint(dst, dtype=jnp.float32)
    assert _assert_matches_state_dict(params, model) == set()


def _rewrite(path, edit):
    sd = load_file(path / "model.safetensors")
    edit(sd)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def ckpt_copy(tmp_path, nemotron):
    dst = tmp_path / "ckpt"
    shutil.copytree(nemotron[0], dst)
    return dst


def test_missing_tensor_is_named(ckpt_copy):
    _rewrite(ckpt_copy, lambda sd: sd.pop("backbone.layers.2.mixer.D"))
    with pytest.raises(ValueError, match=r"'backbone.layers.2.mixer.D'.*layers_2/mixer/D"):
        load_hf_checkpoint(ckpt_copy)


def test_wrong_shape_names_tensor_path_and_both_shapes(ckpt_copy):
    def edit(sd):
        sd["backbone.layers.3.mixer.k_proj.weight"] = torch.randn(12, 48)

    _rewrite(ckpt_copy, edit)
    with pytest.raises(
        ValueError,
        match=r"'backbone.layers.3.mixer.k_proj.weight' has shape \[12, 48\], expected \[24, 48\] "
        r"for layers_3/mixer/k_proj/kernel \(our shape \[48, 24\]\)",
    ):
        load_hf_checkpoint(ckpt_copy)


def test_unexpected_tensor_is_named(ckpt_copy):
    _rewrite(ckpt_copy, lambda sd: sd.update({"backbone.layers.0.mixer.extra": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \['backbone.layers.0.mixer.extra'\]"):
        load_hf_checkpoint(ckpt_copy)


def test_truncated_or_garbage_safetensors_is_named(ckpt_copy):
    file = ckpt_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or corrupted"):
        load_hf_checkpoint(ckpt_copy)
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match=r"cannot read safetensors file .*model\.safetensors"):
        load_hf_checkpoint(ckpt_copy)


def test_missing_files_and_bad_directories_are_named(tmp_path, ckpt_copy, mamba2):
    with pytest.raises(ValueError, match="not a directory"):
        load_hf_checkpoint(tmp_path / "nope")
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors files in checkpoint directory"):
        load_hf_checkpoint(ckpt_copy)
    (ckpt_copy / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"cannot read HF config .*config\.json"):
        load_hf_checkpoint(ckpt_copy)

    sharded = tmp_path / "sharded"
    shutil.copytree(mamba2[0], sharded)
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ValueError, match=f"missing shard .*{victim.name}"):
        load_hf_checkpoint(sharded)


def test_config_and_expected_mismatches_raise(nemotron):
    path, _ = nemotron
    cfg = config_from_hf(path)

    with pytest.raises(ValueError, match=r"ModelConfig.ssm_state_size=16 does not match"):
        load_hf_checkpoint(path, dataclasses.replace(cfg, ssm_state_size=16))
    expected = checkpoint_param_shapes(cfg, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"param embed/embedding: got float32\[97, 48\]"):
        load_hf_checkpoint(path, cfg, dtype=jnp.float32, expected=expected)
    del expected["norm_f"]
    with pytest.raises(ValueError, match=r"unexpected \['norm_f/scale'\]"):
        load_hf_checkpoint(path, cfg, expected=expected)


def test_projection_biases_load_and_absent_conv_bias_is_not_required(tmp_path):
    path, model = make_nemotron_h_checkpoint(
        tmp_path / "bias", pattern="M-", use_bias=True, mlp_bias=True, use_conv_bias=False, seed=5
    )
    cfg = config_from_hf(path)
    assert cfg.mamba_proj_bias and cfg.mlp_bias and not cfg.use_conv_bias
    params = load_hf_checkpoint(path, cfg, dtype=jnp.float32)
    mixer = params["layers_0"]["mixer"]
    assert mixer["in_proj"]["bias"].shape == (cfg.in_proj_dim,) and "bias" not in mixer["conv1d"]
    assert params["layers_1"]["mixer"]["down_proj"]["bias"].shape == (48,)
    assert _assert_matches_state_dict(params, model) == set()


@pytest.mark.parametrize("preset", ["nemotron-h-tiny", "nemotron-nano-9b-v2", "mamba2-130m"])
def test_loader_layout_matches_the_model_parameters(preset):
    from jaxmamba.model.params import param_shapes

    cfg = config_from_preset(preset)
    assert checkpoint_param_shapes(cfg, jnp.bfloat16) == param_shapes(cfg, jnp.bfloat16)
