"""One source of settings: `EngineConfig`/`RunConfig` fields give `LLM(...)`'s keywords and
every command's flags, with their defaults and help; the CLI's vLLM-style forms."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import subprocess
import sys

import pytest

from jaxmamba import LLM, SamplingParams
from jaxmamba.cli import build_parser, main
from jaxmamba.engine.config import EngineConfig, RunConfig
from jaxmamba.model.families import load_config

ENGINE_COMMANDS = {"generate": [], "serve": [], "export": ["--out", "unused"], "aot": []}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_setting_is_a_flag_with_its_default_and_help(command):
    parser = _subparsers()[command]
    flags = _flags(parser)
    args = parser.parse_args(ENGINE_COMMANDS[command])
    help_text = " ".join(parser.format_help().split())
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in flags, (command, flag)
        assert getattr(args, f.name) == f.default, (command, f.name)
        assert " ".join(f.metadata["help"].split()) in help_text, (command, flag)
        if f.default is not None:
            assert f"(default: {f.default})" in help_text, (command, flag)
    assert "--no-enable-prefix-caching" in flags
    assert parser.parse_args([*ENGINE_COMMANDS[command], "--no-enable-prefix-caching"]) != args


def test_run_settings_are_flags_of_generate_and_serve():
    for command in ("generate", "serve"):
        parser = _subparsers()[command]
        args = parser.parse_args([])
        for f in dataclasses.fields(RunConfig):
            assert getattr(args, f.name) == f.default, (command, f.name)
        assert not parser.parse_args(["--no-compilation-cache"]).compilation_cache


def test_every_flag_of_every_command_has_help_text():
    missing = [
        (name, action.option_strings or action.dest)
        for name, parser in _subparsers().items()
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()
    ]
    assert not missing


def test_export_no_prefix_caching_is_a_deprecated_alias(capsys):
    parser = _subparsers()["export"]
    args = parser.parse_args(["--out", "o", "--no-prefix-caching"])
    assert "deprecated: use --no-enable-prefix-caching" in capsys.readouterr().err
    assert args.enable_prefix_caching is False
    assert parser.parse_args(["--out", "o"]).enable_prefix_caching is True


def test_llm_signature_lists_every_setting_with_its_default():
    params = inspect.signature(LLM).parameters
    for cls in (EngineConfig, RunConfig):
        for f in dataclasses.fields(cls):
            assert params[f.name].default == f.default, f.name
            assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY


def test_unknown_llm_keyword_is_a_type_error_naming_the_valid_ones():
    with pytest.raises(
        TypeError, match=r"\['max_num_seq'\] \(did you mean 'max_num_seqs'\?\).*'dtype'"
    ):
        LLM("nemotron-h-tiny", max_num_seq=4)
    with pytest.raises(TypeError, match="engine_config must be an EngineConfig, got dict"):
        LLM("nemotron-h-tiny", engine_config={"max_num_seqs": 2})


def test_llm_takes_a_config_and_keywords_over_it():
    config = EngineConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32)
    llm = LLM("nemotron-h-tiny", engine_config=config, max_model_len=48, page_size=8)
    assert (llm.engine_cfg.max_num_seqs, llm.engine_cfg.max_model_len) == (2, 48)
    assert (llm.engine_cfg.max_num_batched_tokens, llm.engine_cfg.page_size) == (32, 8)


class _Reached(Exception):
    pass


def _capture_llm(monkeypatch) -> dict:
    seen = {}

    @functools.wraps(LLM.__init__)
    def llm_init(self, model, **kwargs):
        seen.update(kwargs, model=model)
        raise _Reached

    monkeypatch.setattr(LLM, "__init__", llm_init)
    return seen


def test_serve_takes_the_model_positionally_as_vllm_serve_does(monkeypatch, capsys):
    seen = _capture_llm(monkeypatch)
    with pytest.raises(_Reached):
        main(["serve", "nemotron-h-tiny", "--max-num-seqs", "3", "--no-enable-prefix-caching"])
    assert seen["model"] == "nemotron-h-tiny"
    assert seen["max_num_seqs"] == 3 and seen["enable_prefix_caching"] is False
    with pytest.raises(_Reached):
        main(["serve", "--model", "nemotron-h-tiny"])
    assert seen["model"] == "nemotron-h-tiny"
    with pytest.raises(_Reached):
        main(["serve", "nemotron-h-tiny", "--model", "nemotron-h-tiny"])
    assert main(["serve", "nemotron-h-tiny", "--model", "mamba2-130m"]) == 2
    assert "two models" in capsys.readouterr().err


def test_cli_generate_prints_n_completions_stopped_on_strings_with_logprobs(capsys):
    """`generate --n 2 --stop S --logprobs 2`: two completions of the prompt, each cut where
    S first appears in the greedy text, each with a logprob line per generated token."""
    engine = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64)
    llm = LLM("nemotron-h-tiny", **engine)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (ref,) = llm.generate("hi", sp, use_tqdm=False)
    text = ref.outputs[0].text
    stop = next(c for c in text[2:] if c.isascii() and c.isalnum())
    want = text[: text.index(stop)]
    argv = ["generate", "--model", "nemotron-h-tiny", "--prompt", "hi", "--max-tokens", "12",
            "--temperature", "0", "--ignore-eos", "--n", "2", "--stop", stop,
            "--logprobs", "2"]  # fmt: skip
    argv += [x for k, v in engine.items() for x in ("--" + k.replace("_", "-"), str(v))]
    assert main(argv) == 0
    out = capsys.readouterr().out
    blocks = out.split("\n--- ")[1:]
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        header, body = block.split("\n", 1)
        assert header == f"'hi' #{i} [stop at {stop!r}]"
        completion, logprobs = body.split("\nlogprobs (cumulative ", 1)
        assert completion == "hi" + want
        token_lines = logprobs.splitlines()[1:]
        assert len(token_lines) >= 1 and all(line.startswith("  ") for line in token_lines)
        assert all(line.count("[") >= 1 for line in token_lines)  # the top-2 besides it


def test_chat_use_tqdm_controls_the_progress_bar(capsys):
    llm = LLM("nemotron-h-tiny", max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    (quiet,) = llm.chat(messages, sp, chat_template=template, use_tqdm=False)
    assert "rocessed prompts" not in capsys.readouterr().err
    (shown,) = llm.chat(messages, sp, chat_template=template, use_tqdm=True)
    assert "rocessed prompts" in capsys.readouterr().err
    assert quiet.outputs[0].token_ids == shown.outputs[0].token_ids
    llm.generate("hi", sp, use_tqdm=False)
    assert "rocessed prompts" not in capsys.readouterr().err


def test_a_hub_id_says_hubs_are_not_reached_and_how_to_use_a_download():
    for load in (load_config, LLM):
        with pytest.raises(ValueError, match="does not reach model hubs") as info:
            load("Qwen/Qwen3.5-9B")
        assert "--local-dir DIR" in str(info.value) and "nemotron-h-demo" in str(info.value)
    with pytest.raises(ValueError, match="neither a directory with config.json"):
        load_config("./no/such/dir")
    with pytest.raises(ValueError, match="unknown model preset"):
        load_config("no-such-preset")


_PROBE = "import logging; logging.basicConfig(level=logging.INFO); {}import jax; jax.devices()"


def test_start_up_does_not_log_the_tpu_backend_probe():
    def stderr(code):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=True).stderr  # fmt: skip

    if "Unable to initialize backend 'tpu'" not in stderr(_PROBE.format("")):
        pytest.skip("jax logs no failed TPU probe on this machine")
    assert "Unable to initialize backend" not in stderr(_PROBE.format("import jaxmamba; "))
