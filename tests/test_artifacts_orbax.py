"""Orbax checkpoints: `jaxmamba convert` of a random HF checkpoint restores bit for bit (the
HF tensors' values, read with safetensors, are exactly the restored ones), `LLM(converted)`
generates what `LLM(hf)` does, and missing, extra or mis-shaped tensors are named."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxmamba import LLM, SamplingParams
from jaxmamba.cli import main
from jaxmamba.model.families import load_config
from jaxmamba.model.orbax_io import (
    ORBAX_SUBDIR,
    checkpoint_specs,
    flat_specs,
    load_orbax_model,
    restore_params,
)

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
