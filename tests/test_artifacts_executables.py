"""`export --executables`: the steps compiled for this machine are stored, and `LLM(DIR)` on
the same device kind and jaxlib loads them instead of compiling (no XLA compile while
generating), with the live engine's greedy tokens; another device's are not loaded (the
exported steps are jitted instead); what a runner compiled can be stored back."""

from __future__ import annotations

import json
import shutil

import jax
import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.export.artifact import programs, runtime_platform
from jaxmamba.export.writer import add_executables, export_artifact

ENGINE = dict(max_num_seqs=1, max_model_len=32, max_num_batched_tokens=8, max_prefill_seqs=1)
PROMPTS = [[3, 90, 17, 41, 5, 200, 11, 64, 9, 33, 120], [7, 8]]
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("exe") / "art"
    # No Orbax weights (another test covers them): the random weights of seed 0, given.
    return export_artifact("nemotron-h-tiny", out, engine=ENGINE, executables=True, weights=False)


@pytest.fixture(scope="module")
def params():
    from jaxmamba.model.families import config_from_preset
    from jaxmamba.model.params import init_params

    return init_params(config_from_preset("nemotron-h-tiny"), seed=0)


def _compiles_while(fn):
    seen = []

    def listen(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            seen.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        result = fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return result, len(seen)


def _tokens(llm):
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _nodes(manifest):
    return [node for b in manifest["buckets"] for _, node in programs(b)]


def test_stored_executables_load_without_compiling(artifact, params, tmp_path):
    manifest = json.loads((artifact / "manifest.json").read_text())
    # 3 buckets; the decode one also holds its sort-free and argmax-only sampler programs.
    assert len(manifest["buckets"]) == 3 and len(_nodes(manifest)) == 5
    here = runtime_platform()  # the default export platform, the one executables are for
    assert all(here in node["executables"] for node in _nodes(manifest))
    llm = LLM(str(artifact), compilation_cache=False, params=params)
    assert llm.runner.loaded_executables == 5
    served, compiles = _compiles_while(lambda: _tokens(llm))
    assert compiles == 0
    assert llm.runner.variant_steps["greedy"] > 0  # greedy decode steps, stored compiled too
    live = LLM("nemotron-h-tiny", compilation_cache=False, seed=0, **ENGINE)
    expected, live_compiles = _compiles_while(lambda: _tokens(live))
    assert live_compiles > 0 and served == expected

    # Executables of another device are not loaded: the exported steps compile instead.
    other = tmp_path / "other"
    shutil.copytree(artifact, other)
    m = json.loads((other / "manifest.json").read_text())
    for node in _nodes(m):
        node["executables"][here]["device"] = "jaxlib 0.0 some other chip"
    (other / "manifest.json").write_text(json.dumps(m))
    fallback = LLM(str(other), compilation_cache=False, params=params)
    assert fallback.runner.loaded_executables == 0
    assert all(hasattr(fn, "lower") for fn in fallback.runner._steps.values())  # jitted

    # What a runner compiled is stored back by add_executables (a step it read from the
    # persistent cache is compiled afresh there); the copy then starts without compiling.
    fallback.engine.precompile(show_progress=False)
    compiled = fallback.runner.num_compiles
    tokens, compiles = _compiles_while(lambda: _tokens(fallback))
    assert tokens == expected and compiles == 0
    # The 5 steps, and the fork and prompt_logprobs programs (compiled here, not stored).
    assert fallback.runner.num_compiles == compiled == 5 + 2, "a step compiled after precompile"
    stored = LLM(str(add_executables(other, tmp_path / "stored", fallback.runner)),
                 compilation_cache=False, params=params)  # fmt: skip
    assert stored.runner.loaded_executables == 5
    again, compiles = _compiles_while(lambda: _tokens(stored))
    assert compiles == 0 and again == expected
