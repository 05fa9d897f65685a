import dataclasses
import json
import math
import re

import pytest

from jaxmamba.config import MODEL_TYPES, ModelConfig, list_presets
from jaxmamba.engine.config import EngineConfig
from jaxmamba.model.families import (
    FAMILIES,
    config_from_hf,
    config_from_preset,
    hf_config_from,
    load_config,
)

NANO_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"


def _nemotron_hf(**kw):
    """A legacy-style (NVIDIA remote-code era) nemotron_h config.json."""
    c = {
        "model_type": "nemotron_h",
        "vocab_size": 101,
        "hidden_size": 40,
        "hybrid_override_pattern": "M*-M-",
        "layer_norm_epsilon": 1e-6,
        "mamba_num_heads": 6,
        "mamba_head_dim": 10,
        "n_groups": 3,
        "ssm_state_size": 12,
        "conv_kernel": 3,
        "chunk_size": 32,
        "use_conv_bias": False,
        "use_bias": True,
        "time_step_min": 0.002,
        "time_step_limit": [0.0, float("inf")],
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "attention_bias": False,
        "intermediate_size": 72,
        "mlp_bias": True,
        "mlp_hidden_act": "relu2",
        "residual_in_fp32": True,
        "tie_word_embeddings": True,
        "bos_token_id": 5,
        "eos_token_id": [7, 9],
        "pad_token_id": 0,
        "num_nextn_predict_layers": 1,
    }
    c.update(kw)
    return c


def _mamba2_hf(**kw):
    c = {
        "model_type": "mamba2",
        "vocab_size": 96,
        "hidden_size": 32,
        "num_hidden_layers": 5,
        "num_heads": 4,
        "head_dim": 16,
        "expand": 2,
        "n_groups": 2,
        "state_size": 24,
        "conv_kernel": 4,
        "chunk_size": 64,
        "time_step_limit": [0.01, {"__float__": "Infinity"}],
        "tie_word_embeddings": False,
        "layer_norm_epsilon": 1e-5,
    }
    c.update(kw)
    return c


def test_presets_give_documented_shapes():
    assert {"nemotron-h-tiny", "nemotron-nano-9b-v2", "mamba2-130m", "mamba2-2.7b"} <= set(
        list_presets()
    )
    tiny = config_from_preset("nemotron-h-tiny")
    assert tiny.name == "nemotron-h-tiny"
    assert (tiny.vocab_size, tiny.hidden_size, tiny.num_layers) == (272, 64, 8)
    assert (tiny.mamba_layers, tiny.attention_layers) == ((0, 2, 4, 6), (3, 7))
    assert tiny.layer_types.count("mlp") == 2
    assert (tiny.d_inner, tiny.conv_dim, tiny.in_proj_dim) == (128, 128 + 64, 256 + 64 + 8)
    assert (tiny.bos_token_id, tiny.eos_token_id, tiny.pad_token_id) == (256, 257, 258)
    assert tiny.time_step_limit == (0.001, math.inf) and not tiny.tie_word_embeddings

    nano = config_from_preset("nemotron-nano-9b-v2")
    assert nano.num_layers == 56 and (nano.num_mamba_layers, nano.num_attention_layers) == (27, 4)
    letters = {"mamba": "M", "attention": "*", "mlp": "-"}
    assert "".join(letters[t] for t in nano.layer_types) == NANO_PATTERN
    assert (nano.d_inner, nano.conv_dim, nano.in_proj_dim) == (10240, 12288, 2 * 10240 + 2048 + 128)
    assert (nano.num_attention_heads, nano.num_key_value_heads, nano.head_dim) == (40, 8, 128)
    assert (nano.intermediate_size, nano.vocab_size, nano.chunk_size) == (15680, 131072, 128)

    for name, hidden, layers, heads in (
        ("mamba2-130m", 768, 24, 24),
        ("mamba2-2.7b", 2560, 64, 80),
    ):
        c = config_from_preset(name)
        assert (c.hidden_size, c.num_layers, c.mamba_num_heads) == (hidden, layers, heads)
        assert c.d_inner == 2 * hidden and c.num_mamba_layers == layers
        assert (c.n_groups, c.ssm_state_size, c.vocab_size) == (1, 128, 50288)
        assert c.tie_word_embeddings and c.attention_layers == ()


def test_yaml_round_trip_keeps_inf_and_every_field(tmp_path):
    cfg = config_from_preset("nemotron-h-tiny")
    cfg.to_yaml(tmp_path / "m.yaml")
    assert ".inf" in (tmp_path / "m.yaml").read_text()
    assert ModelConfig.from_yaml(tmp_path / "m.yaml") == cfg
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_load_dispatches_on_preset_yaml_json_and_directory(tmp_path):
    tiny = load_config("nemotron-h-tiny")
    assert load_config(tiny) is tiny
    tiny.to_yaml(tmp_path / "x.yaml")
    assert load_config(tmp_path / "x.yaml").hidden_size == 64
    (tmp_path / "config.json").write_text(json.dumps(_mamba2_hf()))
    assert load_config(tmp_path).model_type == "mamba2"
    assert load_config(str(tmp_path / "config.json")).num_layers == 5
    with pytest.raises(ValueError, match="unknown model preset 'no-such-model'.*nemotron-h-tiny"):
        load_config("no-such-model")
    with pytest.raises(ValueError, match="config.json"):
        load_config(tmp_path / "empty_dir_missing")  # not a dir: treated as a path
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match=r"sub/config\.json"):
        load_config(tmp_path / "sub")


def test_nemotron_h_legacy_config_is_parsed():
    cfg = config_from_hf(_nemotron_hf())
    assert cfg.layer_types == ("mamba", "attention", "mlp", "mamba", "mlp")
    assert (cfg.n_groups, cfg.conv_kernel, cfg.chunk_size, cfg.norm_eps) == (3, 3, 32, 1e-6)
    assert cfg.mamba_proj_bias and not cfg.use_conv_bias and cfg.mlp_bias
    # dt is clamped to config.time_step_limit; time_step_min only initialises dt_bias.
    assert cfg.time_step_limit == (0.0, math.inf)
    assert cfg.eos_token_id == 7 and cfg.bos_token_id == 5 and cfg.tie_word_embeddings


@pytest.mark.parametrize(
    "layers",
    [
        {"layers_block_type": ["mamba", "attention", "mlp", "mamba", "mlp"]},
        {
            "layers_block_type": [
                "linear_attention",
                "full_attention",
                "mlp",
                "linear_attention",
                "mlp",
            ]
        },
        {"layer_types": ["linear_attention", "full_attention", "mlp", "linear_attention", "mlp"]},
    ],
)
def test_nemotron_h_layer_list_forms_agree_with_pattern(layers):
    by_pattern = config_from_hf(_nemotron_hf())
    c = _nemotron_hf(**layers)
    del c["hybrid_override_pattern"]
    assert config_from_hf(c) == by_pattern
    # An explicit list wins over a stale pattern, as in transformers.
    assert config_from_hf(_nemotron_hf(**layers, hybrid_override_pattern="MM")) == by_pattern


def test_legacy_mamba_prefixed_keys_are_read():
    c = _nemotron_hf(mamba_n_groups=2, mamba_d_conv=2, mamba_chunk_size=16)
    for k in ("n_groups", "conv_kernel", "chunk_size"):
        del c[k]
    cfg = config_from_hf(c)
    assert (cfg.n_groups, cfg.conv_kernel, cfg.chunk_size) == (2, 2, 16)


def test_hf_config_round_trips_through_transformers():
    from transformers import Mamba2Config, NemotronHConfig

    for cfg, cls in (
        (config_from_preset("nemotron-h-tiny"), NemotronHConfig),
        (config_from_hf(_mamba2_hf()), Mamba2Config),
    ):
        hf = cls(**hf_config_from(cfg))
        again = config_from_hf(json.loads(hf.to_json_string()))
        assert again == dataclasses.replace(cfg, name="")
    hf = NemotronHConfig(**hf_config_from(config_from_preset("nemotron-h-tiny")))
    assert hf.hybrid_override_pattern == "M-M*M-M*"
    assert (hf.mamba_num_heads * hf.mamba_head_dim, hf.n_groups) == (128, 2)


def test_mamba2_config_is_parsed():
    cfg = config_from_hf(_mamba2_hf())
    assert cfg.layer_types == ("mamba",) * 5 and cfg.attention_layers == ()
    assert (cfg.d_inner, cfg.conv_dim, cfg.in_proj_dim) == (64, 64 + 96, 128 + 96 + 4)
    assert cfg.time_step_limit == (0.01, math.inf)
    assert cfg.residual_in_fp32  # transformers' Mamba2 default


@pytest.mark.parametrize(
    "config, message",
    [
        (_nemotron_hf(hybrid_override_pattern="M*E-", moe_latent_size=8), "moe_latent_size=8"),
        (
            _nemotron_hf(hybrid_override_pattern="M*E-", n_routed_experts=6, n_group=4),
            "moe_num_groups=4",
        ),
        (_nemotron_hf(hybrid_override_pattern="M?"), r"hybrid_override_pattern\[1\]='\?'"),
        ({**_mamba2_hf(), "model_type": "jamba"}, "model_type 'jamba'"),
        (_nemotron_hf(mlp_hidden_act="gelu"), "mlp_hidden_act='gelu'"),
        (_nemotron_hf(mamba_hidden_act="relu"), "mamba_hidden_act='relu'"),
        (_nemotron_hf(position_embedding_type="rope"), "position_embedding_type='rope'"),
        (_nemotron_hf(sliding_window=128), "sliding_window=128"),
        (_mamba2_hf(expand=3), r"expand\*hidden_size=3\*32"),
        (_nemotron_hf(n_groups=4), "n_groups=4.*mamba_num_heads=6"),
        (_nemotron_hf(num_key_value_heads=4), "num_key_value_heads=4.*num_attention_heads=6"),
        (_nemotron_hf(hidden_size=-8), "hidden_size=-8"),
        (_nemotron_hf(bos_token_id=101), "bos_token_id=101"),
        (_mamba2_hf(time_step_limit=[0.1, 0.01]), "time_step_limit"),
    ],
)
def test_unsupported_or_bad_hf_config_raises_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(config)


def test_bad_dataclass_values_raise_naming_the_field():
    tiny = config_from_preset("nemotron-h-tiny")
    for field, value in (
        ("layer_types", ("mamba", "rwkv")),
        ("mlp_activation", "gelu"),
        ("chunk_size", 0),
        ("norm_eps", 0.0),
        ("model_type", "jamba"),
        ("n_groups", 3),
    ):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(tiny, **{field: value})
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields \['hidden'\]"):
        ModelConfig.from_dict({**tiny.to_dict(), "hidden": 3})
    d = tiny.to_dict()
    del d["head_dim"]
    with pytest.raises(ValueError, match=r"missing ModelConfig fields \['head_dim'\]"):
        ModelConfig.from_dict(d)


def test_model_config_accepts_exactly_the_registered_model_types():
    assert sorted(MODEL_TYPES) == sorted(FAMILIES)


def test_mamba_ssm_cache_dtype_auto_keeps_the_state_float32():
    assert EngineConfig().mamba_ssm_cache_dtype == "float32"
    assert EngineConfig().ssm_dtype == "float32"
    assert EngineConfig(mamba_ssm_cache_dtype="auto").ssm_dtype == "float32"
    assert EngineConfig(mamba_ssm_cache_dtype="bfloat16").ssm_dtype == "bfloat16"


@pytest.mark.parametrize("bad", ["float16", "bf16", "fp32", "", None, 2])
def test_bad_mamba_ssm_cache_dtype_is_refused_naming_the_field_and_the_choices(bad):
    from jaxmamba import LLM

    message = (
        r"EngineConfig.mamba_ssm_cache_dtype must be one of \['auto', 'bfloat16', 'float32'\], "
        rf"got {re.escape(repr(bad))}"
    )
    with pytest.raises(ValueError, match=message):
        EngineConfig(mamba_ssm_cache_dtype=bad)
    with pytest.raises(ValueError, match=message):
        LLM("nemotron-h-tiny", mamba_ssm_cache_dtype=bad)


def test_malformed_config_json_raises_with_its_path(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match=str(tmp_path / "config.json")):
        config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        config_from_hf(tmp_path)


def test_every_eos_id_of_config_json_and_generation_config_json_stops(tmp_path):
    cfg = config_from_hf(_nemotron_hf())
    assert (cfg.eos_token_id, cfg.eos_token_ids) == (7, (7, 9))
    (tmp_path / "config.json").write_text(json.dumps(_nemotron_hf(eos_token_id=4)))
    assert config_from_hf(tmp_path).eos_token_ids == (4,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 4, 11]}))
    cfg = config_from_hf(tmp_path)
    assert (cfg.eos_token_id, cfg.eos_token_ids) == (4, (4, 9, 11))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 12}))
    assert config_from_hf(tmp_path).eos_token_ids == (4, 12)
    # Without an eos in config.json, generation_config.json's lead.
    c = _nemotron_hf()
    del c["eos_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    cfg = config_from_hf(tmp_path)
    assert (cfg.eos_token_id, cfg.eos_token_ids) == (12, (12,))
    # A list survives the HF round trip and our YAML.
    listed = config_from_hf(_nemotron_hf(eos_token_id=[3, 5]))
    assert hf_config_from(listed)["eos_token_id"] == [3, 5]
    assert config_from_hf(hf_config_from(listed)).eos_token_ids == (3, 5)
    listed.to_yaml(tmp_path / "m.yaml")
    assert ModelConfig.from_yaml(tmp_path / "m.yaml").eos_token_ids == (3, 5)


def test_yaml_without_eos_token_ids_takes_eos_token_id(tmp_path):
    d = config_from_preset("nemotron-h-tiny").to_dict()
    del d["eos_token_ids"]
    assert ModelConfig.from_dict(d).eos_token_ids == (257,)
    d["eos_token_id"] = None
    assert ModelConfig.from_dict(d).eos_token_ids == ()


@pytest.mark.parametrize(
    "eos, message",
    [
        ([7, "9"], r"eos_token_id=\[7, '9'\].*int or a list of ints"),
        ([7, 2.0], "eos_token_id"),
        ([7, True], "eos_token_id"),
        ([7, 500], r"eos_token_ids=\(7, 500\)"),
    ],
)
def test_bad_eos_lists_raise_naming_the_field(eos, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(_nemotron_hf(eos_token_id=eos))


def test_bad_generation_config_raises_with_its_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_nemotron_hf()))
    (tmp_path / "generation_config.json").write_text("{ nope")
    with pytest.raises(ValueError, match="generation_config.json"):
        config_from_hf(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1.5]}))
    with pytest.raises(ValueError, match="generation_config.json eos_token_id"):
        config_from_hf(tmp_path)


def test_eos_token_id_must_be_in_eos_token_ids():
    tiny = config_from_preset("nemotron-h-tiny")
    with pytest.raises(ValueError, match="eos_token_ids.*eos_token_id=257"):
        dataclasses.replace(tiny, eos_token_ids=(5, 6))
    assert dataclasses.replace(tiny, eos_token_ids=(257, 6)).eos_token_ids == (257, 6)
