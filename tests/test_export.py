"""``jax.export`` of every Pallas kernel, and of the whole prefill and decode steps of the
built-in model, for TPU and CUDA — on a CPU machine.

The kernel choice is made at trace time, so a model exported for another platform than the
tracing machine names it: ``impl="auto_tpu"`` / ``"auto_gpu"`` (that platform's kernels where
an op has one, the reference elsewhere); single kernels use ``"pallas_tpu"`` / ``"pallas_gpu"``
(see ``kernels/dispatch.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.engine.batch import Bucket
from jaxmamba.engine.runner import ModelRunner, jitted_step
from jaxmamba.export.artifact import input_avals, programs
from jaxmamba.kernels import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    paged_attention,
    selective_state_update,
    small_m_matmul,
)
from jaxmamba.model.cache import CacheSpec
from jaxmamba.model.families import config_from_preset
from jaxmamba.model.params import init_params

from model_helpers import MAX_PAGES, PAGE_SIZE, builder, row

PLATFORMS = {"tpu": "tpu", "cuda": "gpu"}  # jax.export platform -> impl suffix
MARKERS = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
# Triton custom calls carry no serialization-compatibility guarantee; we export anyway.
DISABLED = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def _export(fn, platform, *args, **kwargs):
    return jax.export.export(fn, platforms=(platform,), disabled_checks=DISABLED)(*args, **kwargs)


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


# Each kernel case: (name, fn(impl) -> jittable, arg specs, donated arg numbers).
# Nemotron-Nano-9B-v2 Mamba shapes. The SSD scan's kernels go in this list too (ssd_varlen).
H, P, G, N, D, K, ROWS, SLOTS, T, S = 128, 80, 8, 128, 12288, 4, 8, 17, 512, 4
# and its attention: 40 query / 8 KV heads of 128, 16-token pages, 64 pages a row.
HQ, HKV, DH, PS, MP = 40, 8, 128, 16, 64
PAGES = _spec((S * MP + 1, PS, HKV, DH))


def _attention(impl):
    return lambda q, kp, vp, table, rows, pos: paged_attention(
        q, kp, vp, table, rows, pos, scale=DH**-0.5, impl=impl
    )


KERNEL_CASES = [
    (
        "selective_state_update",
        lambda impl: (
            lambda st, x, dt, a, b, c, s, d, bias: selective_state_update(
                st, x, dt, a, b, c, s, D=d, dt_bias=bias, impl=impl
            )
        ),
        [_spec((SLOTS, H, P, N), jnp.float32), _spec((ROWS, H, P)), _spec((ROWS, H))]
        + [_spec((H,), jnp.float32), _spec((ROWS, G, N)), _spec((ROWS, G, N))]
        + [_spec((ROWS,), jnp.int32), _spec((H,), jnp.float32), _spec((H,), jnp.float32)],
        (0,),
    ),
    (
        "causal_conv1d_update",
        lambda impl: lambda st, x, w, b, s: causal_conv1d_update(st, x, w, b, s, impl=impl),
        [_spec((SLOTS, K - 1, D)), _spec((ROWS, D)), _spec((K, D)), _spec((D,))]
        + [_spec((ROWS,), jnp.int32)],
        (0,),
    ),
    (
        "causal_conv1d_varlen",
        lambda impl: (
            lambda x, w, b, cu, init, te: causal_conv1d_varlen(
                x, w, b, cu, initial_states=init, track_ends=te, impl=impl
            )
        ),
        [_spec((T, D)), _spec((K, D)), _spec((D,)), _spec((S + 1,), jnp.int32)]
        + [_spec((S, K - 1, D)), _spec((S,), jnp.int32)],
        (),
    ),
    (
        "paged_attention_prefill",
        _attention,
        [_spec((T, HQ, DH)), PAGES, PAGES, _spec((S, MP), jnp.int32)]
        + [_spec((T,), jnp.int32)] * 2,
        (),
    ),
    (
        "paged_attention_decode",
        _attention,
        [_spec((ROWS, HQ, DH)), PAGES, PAGES, _spec((ROWS, MP), jnp.int32)]
        + [_spec((ROWS,), jnp.int32)] * 2,
        (),
    ),
]


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernel_exports_for_platform(case, platform):
    _, make, specs, donate = case
    fn = jax.jit(make(f"pallas_{PLATFORMS[platform]}"), donate_argnums=donate)
    exported = _export(fn, platform, *specs)
    module = exported.mlir_module()
    assert MARKERS[platform] in module
    if donate:  # the state pool is updated in place: the kernel aliases it to its output
        assert "output_operand_aliases" in module


@pytest.fixture(scope="module")
def tiny():
    cfg = config_from_preset("nemotron-h-tiny")
    return cfg, init_params(cfg, seed=0)


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_model_step_exports_with_platform_kernels(tiny, platform, step):
    cfg, params = tiny
    spec = CacheSpec(num_slots=4, num_pages=4 * MAX_PAGES, page_size=PAGE_SIZE)
    impl = f"auto_{PLATFORMS[platform]}"
    runner = ModelRunner(cfg, params, spec, dtype=jnp.bfloat16, impl=impl)
    rng = np.random.default_rng(0)
    if step == "prefill":
        rows = [row(rng.integers(0, 256, n).tolist(), 0, slot=i) for i, n in enumerate((13, 6))]
        bucket, num_decode = Bucket(32, 2, 0), 0
    else:
        rows = [row([int(rng.integers(0, 256))], 9, slot=i) for i in range(2)]
        bucket, num_decode = Bucket(4, 4, 4), 4
    inputs = builder(runner).build(rows, bucket)
    args, kwargs = runner.step_args(inputs, num_decode)
    exported = _export(jitted_step, platform, *args, **kwargs)
    module = exported.mlir_module()
    # Every Mamba layer calls its conv kernel, and in decode its state-update kernel too;
    # every attention layer its paged-attention kernel.
    per_layer = 1 if step == "prefill" else 2
    expected = per_layer * cfg.num_mamba_layers + cfg.num_attention_layers
    assert module.count(MARKERS[platform]) >= expected
    assert f"paged_attention_{PLATFORMS[platform]}" in module
    assert exported.platforms == (platform,)


def test_small_m_matmul_kernel_exports_for_cuda():
    fn = jax.jit(lambda x, w: small_m_matmul(x, w, impl="pallas_gpu"))
    module = _export(fn, "cuda", _spec((1, 4480)), _spec((4480, 22656))).mlir_module()
    assert module.count(MARKERS["cuda"]) == 1 and 'name = "small_m_matmul"' in module


@pytest.mark.parametrize(
    "impl, small_m_impl, kernels",
    [("auto_gpu", None, True), ("auto_gpu", "auto_gpu", True), ("auto_gpu", "xla", False),
     ("auto_tpu", None, False)],
)  # fmt: skip
def test_decode_step_exports_with_small_m_matmul_by_default_for_cuda(
    tiny, impl, small_m_impl, kernels
):
    """By default a CUDA decode step runs every projection Linear on the GEMV kernel; "xla"
    keeps XLA's dot, and a TPU step has no such kernel."""
    cfg, params = tiny
    spec = CacheSpec(num_slots=4, num_pages=4 * MAX_PAGES, page_size=PAGE_SIZE)
    runner = ModelRunner(
        cfg, params, spec, dtype=jnp.bfloat16, impl=impl, small_m_impl=small_m_impl
    )
    rng = np.random.default_rng(0)
    rows = [row([int(rng.integers(0, 256))], 9, slot=i) for i in range(2)]
    inputs = builder(runner).build(rows, Bucket(4, 4, 4))
    args, kwargs = runner.step_args(inputs, 4)
    platform = "cuda" if impl.endswith("gpu") else "tpu"
    module = _export(jitted_step, platform, *args, **kwargs).mlir_module()
    linears = 2 * cfg.num_mamba_layers + 4 * cfg.num_attention_layers
    linears += 2 * cfg.layer_types.count("mlp")
    launches = module.count('name = "small_m_matmul"')  # the Triton call's own name
    assert launches >= linears if kernels else launches == 0


def test_artifact_exports_every_bucket_for_tpu_and_cuda(tmp_path):
    """`jaxmamba export --platforms cuda,tpu --no-weights --workers 2`: every bucket of the
    engine is exported for both (in two worker processes), each step calls that platform's
    kernels, and the manifest lists it."""
    import json

    from jaxmamba.cli import main
    from jaxmamba.engine.config import EngineConfig
    from jaxmamba.engine.scheduler import Scheduler

    out = tmp_path / "art"
    argv = ["export", "--model", "nemotron-h-tiny", "--out", str(out), "--platforms", "cuda,tpu",
            "--no-weights", "--max-num-seqs", "1", "--max-model-len", "32",
            "--max-num-batched-tokens", "16", "--workers", "2"]  # fmt: skip
    assert main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["weights"] is None and not (out / "weights").exists()
    cfg = config_from_preset("nemotron-h-tiny")
    engine = EngineConfig(max_num_seqs=1, max_model_len=32, max_num_batched_tokens=16)
    expected = Scheduler(cfg, engine.for_chunk_size(cfg.chunk_size)).all_buckets()
    assert [(b["num_tokens"], b["num_rows"], b["num_decode"]) for b in manifest["buckets"]] == [
        (b.num_tokens, b.num_rows, b.num_decode) for b in expected
    ]
    for entry in manifest["buckets"]:
        decode = entry["num_decode"] == entry["num_rows"]
        # A decode bucket also holds its sort-free and argmax-only sampler programs, a mixed
        # one does not.
        assert sorted(entry.get("variants", {})) == (["greedy", "plain"] if decode else [])
        for platform in ("cuda", "tpu"):
            for sampler, node in programs(entry):
                blob = (out / node["files"][platform]["path"]).read_bytes()
                exported = jax.export.deserialize(bytearray(blob))
                assert exported.platforms == (platform,)
                module = exported.mlir_module()
                assert MARKERS[platform] in module
                assert ("stablehlo.sort" in module) == (sampler == "full"), (entry, sampler)
                # the token bitmask in the FULL program's buffer only
                assert [list(a.shape) for a in exported.in_avals] == [
                    a["shape"] for a in input_avals(entry, node)
                ]
                assert sampler == "full" or node["inputs"] != entry["inputs"], (entry, sampler)


def test_no_sampler_variants_exports_one_program_a_bucket(tmp_path):
    """`--no-sampler-variants`: the decode bucket holds the full sampler's step only, and
    serving runs it for greedy decode steps too."""
    import json

    from jaxmamba.cli import main

    out = tmp_path / "art"
    argv = ["export", "--model", "nemotron-h-tiny", "--out", str(out), "--max-num-seqs", "1",
            "--max-model-len", "16", "--max-num-batched-tokens", "8",
            "--no-sampler-variants"]  # fmt: skip
    assert main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert any(b["num_decode"] == b["num_rows"] for b in manifest["buckets"])
    assert all("variants" not in b for b in manifest["buckets"])
    steps = sorted(p.name for p in (out / "steps" / "cpu").iterdir())
    assert len(steps) == len(manifest["buckets"]) + 1 and "score.jaxexport" in steps
    from jaxmamba import LLM, SamplingParams

    llm = LLM(str(out), compilation_cache=False)
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp, use_tqdm=False)
    steps = llm.runner.variant_steps
    assert steps["full"] == 3 and steps["plain"] == steps["greedy"] == 0
    with pytest.raises(ValueError, match="engine field 'mamba_ssm_cache_dtype' holds 'float32'"):
        LLM(str(out), compilation_cache=False, mamba_ssm_cache_dtype="bfloat16")


def test_artifact_keeps_the_bfloat16_state_dtype(tmp_path):
    """`export --mamba-ssm-cache-dtype bfloat16`: the manifest's cache and engine settings
    hold it, and `LLM(artifact)` runs its steps on a bf16 state cache."""
    import json

    from jaxmamba import LLM, SamplingParams
    from jaxmamba.cli import main

    out = tmp_path / "art"
    argv = ["export", "--model", "nemotron-h-tiny", "--out", str(out), "--max-num-seqs", "1",
            "--max-model-len", "16", "--max-num-batched-tokens", "8", "--no-sampler-variants",
            "--mamba-ssm-cache-dtype", "bfloat16"]  # fmt: skip
    assert main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cache"]["ssm_dtype"] == "bfloat16"
    assert manifest["engine"]["mamba_ssm_cache_dtype"] == "bfloat16"
    llm = LLM(str(out), compilation_cache=False, mamba_ssm_cache_dtype="bfloat16")
    assert llm.runner.cache_spec.ssm_dtype == "bfloat16"
    assert llm.engine_cfg.ssm_dtype == "bfloat16"
    dtypes = [a["dtype"] for a in manifest["state"]["cache"]]  # conv, ssm, k, v pools
    assert dtypes.count("bfloat16") == len(llm.model_cfg.recurrent_layers)
    assert [x.dtype.name for x in llm.runner.cache] == dtypes
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    (result,) = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp, use_tqdm=False)
    assert len(result.outputs[0].token_ids) == 2


_WARM_CACHE_SCRIPT = """
import sys
import jax, jax.numpy as jnp
from jax.experimental.serialize_executable import deserialize_and_load
import pickle
from jaxmamba.export.compile_cache import setup_compilation_cache
from jaxmamba.export.writer import compile_serialized

setup_compilation_cache(sys.argv[1], quiet=True)
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
f = jax.jit(lambda x, y: (jnp.exp(x) * 2 + jnp.tanh(x) + jax.nn.softplus(y), y + 1),
            donate_argnums=(1,))
specs = [jax.ShapeDtypeStruct((4096,), jnp.float32)] * 2
exported = jax.export.export(f)(*specs)
plain = lambda: jax.jit(exported.call).lower(*specs).compile()
plain()  # fills the persistent cache
plain()
assert hits, "the second plain compile did not come from the persistent cache"
x = jax.random.normal(jax.random.key(0), (4096,))
want = f(x, x + 0.5)
for _ in range(2):  # the second one meets a warm cache
    got = deserialize_and_load(*pickle.loads(compile_serialized(exported)))(x, x + 0.5)
    for g, w in zip(got, want):
        assert float(jnp.abs(g - w).max()) <= 1e-6, float(jnp.abs(g - w).max())
print("ok")
"""


def test_serialized_executables_load_when_the_persistent_cache_is_warm(tmp_path):
    """An executable XLA:CPU read back from the persistent cache serializes without the
    runtime functions it links ('Function ... not found' when loaded): `compile_serialized`
    must compile afresh even when the cache holds the step. In a fresh process, since JAX
    fixes its cache set-up at the first compile."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _WARM_CACHE_SCRIPT, str(tmp_path / "xla")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
