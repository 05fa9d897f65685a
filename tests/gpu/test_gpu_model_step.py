"""The whole model step with every GPU kernel together (``impl="auto"``) in bf16 against the
reference path (``impl="ref"``) on the same weights, one tiny preset per family, over a
prefill that writes a checkpoint, a decode step whose row crosses its checkpoint length, and a
mixed step with a row that starts from a checkpoint (a prefix-cache hit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_tier import INTERPRET, assert_close, cases, skip_unless_gpu

skip_unless_gpu()

from jaxmamba.engine.batch import Bucket  # noqa: E402
from jaxmamba.engine.runner import ModelRunner  # noqa: E402
from jaxmamba.model.families import config_from_preset  # noqa: E402
from jaxmamba.model.params import init_params  # noqa: E402

from model_helpers import MAX_PAGES, builder, make_runner, pages_for, row  # noqa: E402

# Interpreted, "auto" would be the references on CPU: "interpret" runs the kernels there (the
# TPU kernel where an op has one), which checks this module's steps and comparisons.
KERNELS = "interpret" if INTERPRET else "auto"
# Logits after up to three steps through every layer, each impl rounding its bf16 activations
# at different points: a few bf16 ulps of the logits' scale.
LOGIT_TOL = {jnp.dtype(jnp.bfloat16): 5e-2, jnp.dtype(jnp.float32): 5e-3}
PRESETS = cases(["nemotron-h-tiny", "qwen3-next-tiny"], ["nemotron-h-demo"])
CHECKPOINT = 64  # a multiple of every preset's chunk size, within a slot's 128 tokens


def _steps(vocab: int, seed: int):
    """(name, rows, bucket, decode rows) of each step, in order, over the slots 0-4 and the
    checkpoint slots 6 and 7."""
    rng = np.random.default_rng(seed)
    prompt = [rng.integers(0, vocab, n).tolist() for n in (63, 100, 1, 40)]
    hit = prompt[1][:CHECKPOINT] + rng.integers(0, vocab, 16).tolist()
    # Slot 4 reads slot 6's checkpoint of slot 1's first 64 tokens, and their KV pages.
    hit_row = row(hit[CHECKPOINT:], CHECKPOINT, 4, init_slot=6)
    hit_row.pages = pages_for(1, CHECKPOINT) + [4 * MAX_PAGES + i for i in range(4)]
    return [
        ("prefill with a checkpoint", [
            row(prompt[0], 0, 0), row(prompt[1], 0, 1, track_slot=6, track_len=CHECKPOINT),
            row(prompt[2], 0, 2)], Bucket(256, 3, 0), None),
        ("decode crossing a checkpoint", [
            row([prompt[1][0]], 63, 0, track_slot=7, track_len=CHECKPOINT),
            row([prompt[0][0]], 100, 1), row([prompt[2][0]], 1, 2)], Bucket(4, 4, 4), None),
        ("mixed with a prefix hit", [
            row([prompt[2][0]], 64, 0), row([prompt[0][1]], 101, 1), row(prompt[3], 0, 3),
            hit_row], Bucket(64, 4, 2), 2),
    ]  # fmt: skip


@pytest.mark.parametrize("name", PRESETS)
def test_model_steps_with_every_kernel_match_the_reference_path(name):
    cfg = config_from_preset(name)
    dtype = jnp.bfloat16
    params = init_params(cfg, dtype, seed=0)
    spec = make_runner(cfg, params, dtype=dtype).cache_spec
    runners = {impl: ModelRunner(cfg, params, spec, dtype=dtype, impl=impl)
               for impl in (KERNELS, "ref")}  # fmt: skip
    for step, rows, bucket, decode_rows in _steps(cfg.vocab_size, seed=len(name)):
        logits = {}
        for impl, runner in runners.items():
            inputs = builder(runner).build(rows, bucket, num_decode_rows=decode_rows)
            logits[impl] = np.asarray(runner.forward_logits(inputs, bucket.num_decode))
        real = sum(len(r.tokens) for r in rows)
        # A mixed bucket's filler decode rows sit between the real decode rows and the rest.
        filler = bucket.num_decode - (decode_rows or bucket.num_decode)
        keep = np.r_[0 : (decode_rows or 0), (decode_rows or 0) + filler : real + filler]
        if not 0 < bucket.num_decode < bucket.num_rows:
            keep = np.arange(real)
        assert_close(logits[KERNELS][keep], logits["ref"][keep], dtype, f"{name}, {step}: logits",
                     tol=LOGIT_TOL[jnp.dtype(dtype)])  # fmt: skip
    used = np.array([0, 1, 2, 3, 4, 6, 7])  # running rows and both checkpoints
    caches = {impl: r.cache for impl, r in runners.items()}
    for kind in ("conv", "ssm"):
        for i, (a, b) in enumerate(zip(getattr(caches[KERNELS], kind), getattr(caches["ref"], kind),
                                       strict=True)):  # fmt: skip
            assert_close(a[used], b[used], dtype, f"{name}: {kind} state of layer {i}",
                         tol=LOGIT_TOL[jnp.dtype(dtype)])  # fmt: skip
    assert jax.tree.structure(caches[KERNELS]) == jax.tree.structure(caches["ref"])
