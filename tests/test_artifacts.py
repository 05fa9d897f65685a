"""Exported artifacts (`jaxmamba export`): a fresh process serves the artifact alone, without
the model code, and its greedy tokens and logprobs equal the live engine's and HF
transformers' (a random float32 checkpoint), prefix-cache hit included; decode steps that
need no sort run the artifact's sort-free sampler program, with the same tokens and
logprobs; constrained requests (structured outputs) give the live engine's tokens, and an
artifact whose FULL programs take no token bitmask refuses them; an artifact exported with
n-gram speculation speculates, with the live engine's greedy tokens, and refuses other
speculative configs by key; a format 3 manifest still serves; a corrupted or mismatched
artifact is rejected naming the field."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxmamba import LLM, SamplingParams, StructuredOutputsParams
from jaxmamba.export.artifact import MANIFEST, ArtifactError, read_artifact, runtime_platform
from jaxmamba.export.writer import export_artifact

from hf_fixtures import make_nemotron_h_checkpoint
from model_helpers import random_prompts

ROOT = Path(__file__).resolve().parents[1]
# 3 buckets (one decode, a prefill, a mixed step); track_interval 8 so the 19-token prompt
# leaves a prefix for the second pass (in one of the spare state slots).
ENGINE = dict(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=16, max_prefill_seqs=1,
              page_size=4, track_interval=8, num_state_slots=4)  # fmt: skip
MAX_TOKENS = 6
# The model code: none of it may be imported by a process that serves an artifact.
MODEL_MODULES = tuple(
    f"jaxmamba.model.{m}" for m in ("model", "layers", "mamba2", "attention", "params", "loader")
)

SERVE = """
import json, sys
from jaxmamba import LLM, SamplingParams
llm = LLM(sys.argv[1], compilation_cache=False)
sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
runs = []
for _ in range(2):  # the second pass hits the prefix cache
    outs = llm.generate(prompt_token_ids=json.loads(sys.argv[2]), sampling_params=sp,
                        use_tqdm=False)
    runs.append([{"tokens": o.outputs[0].token_ids, "cached": o.num_cached_tokens,
                  "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                               o.outputs[0].token_ids)]}
                 for o in outs])
print(json.dumps({"runs": runs, "modules": sorted(sys.modules),
                  "compiles": llm.stats()["compilations"]}))
""".replace("MAX_TOKENS", str(MAX_TOKENS))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tokenizers import Tokenizer, decoders

    path, model = make_nemotron_h_checkpoint(tmp_path_factory.mktemp("hf"), with_tokenizer=True)
    # The same text through the sentencepiece-style decoder, whose token bytes llguidance
    # (structured outputs) can read; it cannot read a Metaspace decoder's.
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok.save(str(path / "tokenizer.json"))
    return path, model.eval()


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    # This machine's platform, and CPU's for the fresh process that serves it on CPU.
    return export_artifact(
        str(checkpoint[0]), tmp_path_factory.mktemp("export") / "art", engine=ENGINE,
        platforms=sorted({"cpu", runtime_platform()}),
    )  # fmt: skip


@pytest.fixture(scope="module")
def live(checkpoint):
    """The live engine on the artifact's checkpoint and settings."""
    return LLM(str(checkpoint[0]), compilation_cache=False, **ENGINE)


@pytest.fixture(scope="module")
def prompts(checkpoint):
    return random_prompts(np.random.default_rng(3), [19, 1, 7], 97)


def _result(outs):
    return [
        {
            "tokens": o.outputs[0].token_ids,
            "cached": o.num_cached_tokens,
            "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                        o.outputs[0].token_ids, strict=True)],
        }
        for o in outs
    ]  # fmt: skip


def test_fresh_process_serves_the_artifact_without_the_model_code(artifact, checkpoint, prompts,
                                                                  live):  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", SERVE, str(artifact), json.dumps(prompts)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    served = json.loads(run.stdout.strip().splitlines()[-1])
    imported = [m for m in MODEL_MODULES if m in served["modules"]]
    assert not imported, f"the artifact process imported the model code: {imported}"
    assert "jaxmamba.export.serving" in served["modules"]
    assert 1 <= served["compiles"] <= len(read_artifact(artifact).buckets())

    # The live engine on the same checkpoint and settings, twice as well.
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = [_result(live.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False))
            for _ in range(2)]  # fmt: skip
    first, second = served["runs"]
    assert second[0]["cached"] > 0 and runs[1][0]["cached"] == second[0]["cached"]
    for ours, theirs in zip(first + second, runs[0] + runs[1], strict=True):
        assert ours["tokens"] == theirs["tokens"]
        np.testing.assert_allclose(ours["logprobs"], theirs["logprobs"], atol=1e-5, rtol=0)

    # HF transformers, the independent oracle.
    for prompt, ours, again in zip(prompts, first, second, strict=True):
        hf_tokens, hf_logprobs = _hf_greedy(checkpoint[1], prompt)
        assert ours["tokens"] == hf_tokens and again["tokens"] == hf_tokens
        np.testing.assert_allclose(ours["logprobs"], hf_logprobs, atol=1e-4, rtol=0)
        np.testing.assert_allclose(again["logprobs"], hf_logprobs, atol=1e-4, rtol=0)


def _hf_greedy(model, prompt):
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
            do_sample=False, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = gen.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(lg[0].float(), -1)[t].item()
                for lg, t in zip(gen.logits, tokens, strict=True)]  # fmt: skip
    return tokens, logprobs


def test_decode_steps_run_the_sort_free_program_with_the_same_results(artifact, checkpoint,
                                                                        prompts):  # fmt: skip
    """The decode bucket is exported three times (the full sampler, the sort-free one and the
    argmax-only one); a greedy request without top logprobs (logprobs=0: the sampled token's
    only) decodes on the sort-free program, one asking for no logprobs on the argmax-only one,
    one asking for top logprobs on the full one, with equal tokens and sampled logprobs, and
    HF's tokens and logprobs."""
    m = read_artifact(artifact).manifest
    decode = [b for b in m["buckets"] if b["num_decode"] == b["num_rows"]]
    assert decode and all(set(b["variants"]) == {"plain", "greedy"} for b in decode)
    assert all("variants" not in b for b in m["buckets"] if b not in decode)
    llm = LLM(str(artifact), compilation_cache=False)
    steps = llm.runner.variant_steps
    results = {}
    for logprobs in (0, 2):
        before = dict(steps)
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=logprobs)  # fmt: skip
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        results[logprobs] = _result(outs)
        ran = {k: steps[k] - before.get(k, 0) for k in steps}
        assert ran.get("plain", 0) == (len(prompts) * (MAX_TOKENS - 1) if logprobs == 0 else 0), ran
        assert ran.get("greedy", 0) == 0, ran
        assert ran["full"] > 0  # the prefill steps
    before = dict(steps)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    ran = {k: steps[k] - before.get(k, 0) for k in steps}
    assert ran.get("greedy", 0) == len(prompts) * (MAX_TOKENS - 1) and not ran.get("plain"), ran
    for out, full in zip(outs, results[2], strict=True):  # no logprobs: their sum
        assert out.outputs[0].token_ids == full["tokens"]
        np.testing.assert_allclose(out.outputs[0].cumulative_logprob, sum(full["logprobs"]),
                                   atol=1e-5, rtol=0)  # fmt: skip
    for plain, full, prompt in zip(results[0], results[2], prompts, strict=True):
        assert plain["tokens"] == full["tokens"]
        np.testing.assert_allclose(plain["logprobs"], full["logprobs"], atol=1e-6, rtol=0)
        hf_tokens, hf_logprobs = _hf_greedy(checkpoint[1], prompt)
        assert plain["tokens"] == hf_tokens
        np.testing.assert_allclose(plain["logprobs"], hf_logprobs, atol=1e-4, rtol=0)


def test_manifest_lists_every_bucket_with_shapes(artifact):
    m = read_artifact(artifact).manifest
    from jaxmamba.config import ModelConfig
    from jaxmamba.engine.batch import Bucket, StepBuilder
    from jaxmamba.engine.config import EngineConfig
    from jaxmamba.engine.scheduler import Scheduler
    from jaxmamba.model.cache import CacheSpec

    cfg = ModelConfig.from_dict(m["model"])
    engine = EngineConfig(**m["engine"])
    buckets = Scheduler(cfg, engine).all_buckets()
    builder = StepBuilder(CacheSpec(**m["cache"]), engine.max_pages_per_seq, cfg.vocab_size,
                          cfg.chunk_size)  # fmt: skip
    assert [(b["num_tokens"], b["num_rows"], b["num_decode"]) for b in m["buckets"]] == [
        (b.num_tokens, b.num_rows, b.num_decode) for b in buckets
    ]
    assert m["format_version"] == 4 and m["structured_outputs"] is True
    assert m["engine"]["speculative_config"] is None
    for b in m["buckets"]:
        n_in = m["state"]["params"] + len(m["state"]["cache"]) + len(m["state"]["slot_state"])
        # The step's inputs: one int32 buffer, every field the bucket's padding has, packed;
        # the FULL program's also the token bitmask (a word per 32 tokens a row), the
        # variants' not (listed in their own node)
        padding = builder.padding(Bucket(b["num_tokens"], b["num_rows"], b["num_decode"]))
        size = sum(np.size(x) for x in padding if x is not None)
        mask = b["num_rows"] * -(-cfg.vocab_size // 32)
        assert b["inputs"][n_in:] == [{"shape": [size + mask], "dtype": "int32"}]
        for variant in b.get("variants", {}).values():
            assert variant["inputs"][n_in:] == [{"shape": [size], "dtype": "int32"}]
            assert variant["inputs"][:n_in] == b["inputs"][:n_in]
        assert m["input_fields"] == list(padding._fields)
        # The packed samples (their layout is the step's), then the donated cache and state.
        state = m["state"]["cache"] + m["state"]["slot_state"]
        assert b["outputs"][1:] == state and b["inputs"][m["state"]["params"] : n_in] == state
        assert len(b["in_shardings"]) == len(b["inputs"]) and b["num_devices"] == 1
    assert (Path(artifact) / "tokenizer" / "tokenizer.json").is_file()


def _copy(artifact, tmp_path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(artifact, dst)
    return dst


def _edit(path: Path, change) -> None:
    m = json.loads((path / MANIFEST).read_text())
    change(m)
    (path / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize(
    "change, field, held, expected",
    [
        (lambda m: m.update(jax_version="0.0.1"), "jax_version", "0.0.1", None),
        (lambda m: m.update(format_version=99), "format_version", "99", "[2, 3, 4]"),
        (lambda m: m.pop("structured_outputs"), "structured_outputs", None, None),
        (lambda m: m.update(structured_outputs=False), "inputs", "False", "without the token"),
        (lambda m: m.update(platforms=["tpu"]), "platforms", "['tpu']", repr(runtime_platform())),
        (lambda m: m["input_fields"].pop(), "input_fields", None, "penalty_reset"),
        (lambda m: m["model"].update(vocab_size=101), "state.slot_state", "97", "101"),
        (lambda m: m["buckets"][1]["outputs"][0]["shape"].__setitem__(1, 7), "outputs", "7",
         None),
        (lambda m: m["engine"].update(max_num_seqs=2), "buckets", None, None),
    ],
    ids=["jax_version", "format_version", "structured_outputs", "bitmask", "platform",
         "input_fields", "config", "shapes", "engine"],
)  # fmt: skip
def test_mismatched_manifest_is_rejected_naming_the_field(
    artifact, tmp_path, change, field, held, expected
):
    import jax

    path = _copy(artifact, tmp_path)
    _edit(path, change)
    with pytest.raises(ArtifactError) as err:
        LLM(str(path), compilation_cache=False)  # LLM's defaults: the artifact's settings
    message = str(err.value)
    assert repr(field) in message, message
    for text in (held, expected):
        if text is not None:
            assert text in message, message
    if field == "jax_version":
        assert jax.__version__ in message


def test_corrupted_files_are_rejected(artifact, tmp_path):
    path = _copy(artifact, tmp_path)
    step = sorted((path / "steps" / runtime_platform()).iterdir())[1]  # the steps LLM loads
    blob = bytearray(step.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    step.write_bytes(bytes(blob))
    with pytest.raises(ArtifactError, match=rf"{step.name}: corrupted: sha256"):
        LLM(str(path), compilation_cache=False, **ENGINE)
    (path / MANIFEST).write_text((path / MANIFEST).read_text()[:-100])
    with pytest.raises(ArtifactError, match="corrupted, not JSON"):
        LLM(str(path), compilation_cache=False)


def test_asking_for_other_engine_settings_is_rejected(artifact):
    with pytest.raises(ArtifactError, match="'max_num_seqs' holds 1, expected 4"):
        LLM(str(artifact), compilation_cache=False, **{**ENGINE, "max_num_seqs": 4})


CHOICES = ["mamba", "attention", "state space"]
REGEX = "[a-m]{2,5}"


def test_artifact_serves_constrained_requests_with_the_live_engines_tokens(artifact, live):
    """Greedy choice and regex requests beside an unconstrained one, on the artifact (its FULL
    programs take the token bitmask) and the live engine: the same tokens, which satisfy the
    constraints; the decode steps of a constrained row run FULL, the unconstrained ones not."""
    params = [
        SamplingParams(max_tokens=12, temperature=0.0,
                       structured_outputs=StructuredOutputsParams(choice=CHOICES)),
        SamplingParams(max_tokens=12, temperature=0.0,
                       structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    ]  # fmt: skip
    prompts = ["the state of", "hello", "mamba layers scan"]
    served = LLM(str(artifact), compilation_cache=False)
    assert served.runner.structured_outputs
    steps = served.runner.variant_steps
    before = dict(steps)
    ours = served.generate(prompts, params, use_tqdm=False)
    ran = {k: steps[k] - before.get(k, 0) for k in steps}
    theirs = live.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        assert a.error is None and a.outputs[0].token_ids == b.outputs[0].token_ids, (a, b)
    choice, regex, free = (o.outputs[0] for o in ours)
    assert choice.text in CHOICES and choice.finish_reason == "stop", choice
    assert re.fullmatch(REGEX, regex.text) and regex.finish_reason == "stop", regex
    assert len(free.token_ids) == MAX_TOKENS
    assert ran["full"] >= len(choice.token_ids) + len(regex.token_ids) and ran.get("greedy"), ran


def test_artifact_without_the_bitmask_refuses_constrained_requests(checkpoint, tmp_path):
    """An artifact exported with FULL programs that take no token bitmask (or an older one:
    format version 2, without the manifest's `structured_outputs`) serves unconstrained
    requests and refuses constrained ones, saying why."""
    from jaxmamba.engine.batch import Bucket

    path = export_artifact(str(checkpoint[0]), tmp_path / "art", engine=ENGINE,
                           buckets=[Bucket(16, 1, 0)], structured_outputs=False)  # fmt: skip
    m = read_artifact(path).manifest
    assert m["structured_outputs"] is False
    older = _copy(path, tmp_path / "older")
    _edit(older, lambda m: (m.pop("structured_outputs"), m.update(format_version=2)))
    refusal = ("FULL sampler programs that take the token bitmask.*exported artifact.*"
               "'structured_outputs'")  # fmt: skip
    choice = StructuredOutputsParams(choice=CHOICES)
    for art in (path, older):
        llm = LLM(str(art), compilation_cache=False)
        assert not llm.runner.structured_outputs
        with pytest.raises(ValueError, match=refusal):
            llm.generate(["hello"], SamplingParams(max_tokens=4, structured_outputs=choice))
        out = llm.generate(["hello"], SamplingParams(max_tokens=1, temperature=0.0),
                           use_tqdm=False)  # fmt: skip
        assert len(out[0].outputs[0].token_ids) == 1


# -- n-gram speculative decoding from an artifact ------------------------------------------------

# The tiny preset, one decode row: 4 buckets (decode, its verify bucket of 1 + 2 tokens, a
# prefill, a mixed step); its greedy continuation of this prompt falls into a cycle, which
# prompt lookup drafts.
SPEC_MODEL = "nemotron-h-tiny"
SPEC_ENGINE = dict(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=16,
                   enable_prefix_caching=False)  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
REPEATING = [[5, 6, 7, 8] * 4]


@pytest.fixture(scope="module")
def ngram_artifact(tmp_path_factory):
    return export_artifact(SPEC_MODEL, tmp_path_factory.mktemp("ngram") / "art",
                           engine={**SPEC_ENGINE, "speculative_config": NGRAM})  # fmt: skip


def test_ngram_artifact_speculates_with_the_live_engines_greedy_tokens(ngram_artifact):
    """`LLM(DIR)` of an artifact exported with an n-gram speculative_config runs its verify
    programs (drafts accepted) and gives the live non-speculative engine's greedy tokens;
    asking for the recorded config, `disable_by_batch_size` aside, is accepted."""
    m = read_artifact(ngram_artifact).manifest
    assert m["format_version"] == 4
    assert m["engine"]["speculative_config"]["num_speculative_tokens"] == 2
    verify = [b for b in m["buckets"] if (b["num_tokens"], b["num_rows"]) == (3, 1)]
    assert len(verify) == 1 and sorted(verify[0]["variants"]) == ["greedy", "plain"]

    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    asked = {**NGRAM, "disable_by_batch_size": 1}  # scheduling only: may differ
    served = LLM(str(ngram_artifact), compilation_cache=False, speculative_config=asked)
    assert served.engine_cfg.speculative_config.disable_by_batch_size == 1
    assert served.runner.speculative.num_tokens == 2
    ours = served.generate(prompt_token_ids=REPEATING, sampling_params=sp, use_tqdm=False)
    live = LLM(SPEC_MODEL, compilation_cache=False, **SPEC_ENGINE)
    theirs = live.generate(prompt_token_ids=REPEATING, sampling_params=sp, use_tqdm=False)
    assert ours[0].outputs[0].token_ids == theirs[0].outputs[0].token_ids
    stats = served.stats()
    assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] > 0, stats


@pytest.mark.parametrize(
    "asked, message",
    [
        ({**NGRAM, "num_speculative_tokens": 3},
         "'speculative_config.num_speculative_tokens' holds 2, expected 3"),
        ({**NGRAM, "prompt_lookup_max": 2}, "'speculative_config.prompt_lookup_max' holds 4"),
        ({"method": "draft_model", "model": SPEC_MODEL}, "'draft_model'.*weights"),
        ({"method": "mtp"}, "'mtp'.*weights"),
    ],
    ids=["k", "lookup", "draft_model", "mtp"],
)  # fmt: skip
def test_other_speculative_configs_are_refused_naming_the_key(ngram_artifact, asked, message):
    with pytest.raises(ArtifactError, match=message):
        LLM(str(ngram_artifact), compilation_cache=False, speculative_config=asked)


def test_speculation_the_artifact_was_not_exported_for_is_refused(artifact, tmp_path):
    """An artifact exported without speculation refuses a speculative_config by name, and one
    whose verify buckets stop at `disable_by_batch_size` refuses a larger one."""
    with pytest.raises(ArtifactError, match="'speculative_config' holds None.*no verify"):
        LLM(str(artifact), compilation_cache=False, speculative_config=NGRAM)
    from jaxmamba.engine.batch import Bucket

    engine = {**SPEC_ENGINE, "max_num_seqs": 2,
              "speculative_config": {**NGRAM, "disable_by_batch_size": 1}}  # fmt: skip
    path = export_artifact(SPEC_MODEL, tmp_path / "art", engine=engine,
                           buckets=[Bucket(3, 1, 1)], sampler_variants=False)  # fmt: skip
    with pytest.raises(ArtifactError, match=r"'speculative_config.disable_by_batch_size' "
                                            r"holds 1, expected None.*\(6, 2, 2\)"):  # fmt: skip
        LLM(str(path), compilation_cache=False, speculative_config=NGRAM)


def test_format_3_artifacts_still_serve(artifact, tmp_path):
    """A version 3 manifest (before speculation in artifacts) serves as it did; one that says
    it speculates is corrupted."""
    older = _copy(artifact, tmp_path)
    _edit(older, lambda m: m.update(format_version=3))
    llm = LLM(str(older), compilation_cache=False)
    assert llm.runner.speculative is None
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                       sampling_params=SamplingParams(max_tokens=2, temperature=0.0))  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 2
    _edit(older, lambda m: m["engine"].update(speculative_config=NGRAM))
    with pytest.raises(ArtifactError, match="format version 3 artifacts do not speculate"):
        read_artifact(older)


def test_aot_refuses_a_speculative_config_by_name():
    """`jaxmamba aot` compiles the plain steps only: a speculative_config is refused before
    anything compiles, not dropped."""
    from jaxmamba.export.aot import aot_compile

    engine = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    with pytest.raises(ValueError, match="speculative_config: jaxmamba aot compiles the plain"):
        aot_compile("nemotron-h-tiny", engine=engine)
