"""The shipped demo checkpoint (configs/nemotron-h-demo) and the script that trains it."""

from __future__ import annotations

import importlib.util
import re
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from family_checks import assert_logits_close, hf_logits

from jaxmamba import LLM, SamplingParams
from jaxmamba.config import preset_path
from jaxmamba.model.families import load_config
from jaxmamba.model.loader import load_hf_checkpoint

from model_helpers import make_runner, prefill_logits, row

DEMO = "nemotron-h-demo"
REPO = Path(__file__).resolve().parents[1]


def load_train_demo():
    spec = importlib.util.spec_from_file_location("train_demo", REPO / "scripts/train_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    path = preset_path(DEMO)
    assert path is not None and path.is_dir(), f"preset {DEMO} is not a checkpoint directory"
    return path


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEMO, max_num_seqs=2, max_model_len=256, max_num_batched_tokens=64)


def test_demo_checkpoint_fits_the_package_budget(demo_dir):
    assert (demo_dir / "model.safetensors").stat().st_size <= 8_000_000
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (demo_dir / name).is_file(), name


def test_demo_tokenizer_ids_are_the_utf8_bytes(demo_dir, llm):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    rng = np.random.default_rng(0)
    # ASCII, Latin-1, CJK, emoji and control characters: 1- to 4-byte UTF-8 sequences.
    ranges = [(0, 0x80, 200), (0x80, 0x800, 50), (0x4E00, 0xA000, 50), (0x1F600, 0x1F650, 20)]
    points = np.concatenate([rng.integers(lo, hi, n) for lo, hi, n in ranges])
    text = "".join(chr(int(c)) for c in rng.permutation(points)) + " def f(x):\n\treturn x "
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert [tok.token_to_id(s) for s in ("<s>", "</s>", "<pad>")] == [256, 257, 258]
    assert tok.get_vocab_size() == load_config(DEMO).vocab_size
    assert llm.tokenizer.encode(text) == [256, *text.encode("utf-8")]
    assert llm.tokenizer.eos_token_id == 257


def test_demo_greedy_completion_is_readable_text(llm):
    out = llm.generate(["def main("], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    text = out.text
    printable = sum(c in string.printable for c in text)
    assert printable >= 0.9 * len(text), repr(text)
    assert len(re.findall(r"[A-Za-z]{3,}", text)) >= 3, repr(text)


def test_demo_logits_match_hf_transformers(demo_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    cfg = load_config(str(demo_dir))
    runner = make_runner(cfg, load_hf_checkpoint(demo_dir, cfg, dtype=np.float32), num_slots=1)
    text = 'import os\n\n\ndef main(argv):\n    """Print every argument."""\n    for a in argv:\n'
    prompt = [cfg.bos_token_id, *text.encode()]
    (ours,) = prefill_logits(runner, [row(prompt, 0, 0)])
    assert_logits_close(ours, hf_logits(model, prompt))


def test_source_files_skip_test_suites_and_hold_out_every_20th(tmp_path):
    demo = load_train_demo()
    for rel in ("a.py", "pkg/b.py", "test/c.py", "pkg/tests/d.py", "idlelib/idle_test/e.py",
                "site-packages/f.py", "pkg/test_g.py", "notes.txt"):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    files = demo.source_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a.py", "pkg/b.py"]
    names = [Path(f"{i:02d}.py") for i in range(45)]
    train, held = demo.split_files(names)
    assert held == [Path("19.py"), Path("39.py")]
    assert sorted(train + held) == names


def toy_source(tmp_path: Path) -> Path:
    """20 small Python files: one held out."""
    source = tmp_path / "src"
    source.mkdir()
    for i in range(20):
        (source / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 8)
    return source


def test_train_demo_smoke_writes_a_checkpoint_the_engine_loads(tmp_path):
    demo = load_train_demo()
    source = toy_source(tmp_path)
    out = tmp_path / "ckpt"
    assert demo.main(["--smoke", "--out", str(out), "--source", str(source), "--no-samples"]) == 0
    readme = (out / "README.md").read_text()
    assert "--smoke" in readme and "bits per byte" in readme
    llm = LLM(str(out), max_num_seqs=1, max_model_len=64, max_num_batched_tokens=16)
    assert llm.model_cfg.layer_types == demo.SMOKE_CONFIG.layer_types
    assert llm.tokenizer.encode("é") == [256, 0xC3, 0xA9]


def test_train_demo_draft_smoke_serves_as_the_demo_models_draft_with_identical_greedy_output(
    tmp_path, llm
):
    demo = load_train_demo()
    out = tmp_path / "draft"
    argv = ["--draft", "--smoke", "--out", str(out), "--source", str(toy_source(tmp_path))]
    assert demo.main([*argv, "--no-samples"]) == 0
    readme = (out / "README.md").read_text()
    assert "--draft --smoke" in readme and "agreement with `nemotron-h-demo`" in readme
    spec = {"method": "draft_model", "model": str(out), "num_speculative_tokens": 3}
    drafted = LLM(DEMO, speculative_config=spec, max_num_seqs=2, max_model_len=256,
                  max_num_batched_tokens=64)  # fmt: skip
    assert drafted.runner.speculative.model.cfg.layer_types == demo.DRAFT_CONFIG.layer_types
    greedy = SamplingParams(temperature=0, max_tokens=24)
    (want,) = llm.generate(["def main("], greedy, use_tqdm=False)
    (got,) = drafted.generate(["def main("], greedy, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert drafted.stats()["spec_verify_steps"] > 0


CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Parse the config file."},
]


def test_demo_chat_renders_its_template_as_transformers_does_and_replies(demo_dir, llm):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(demo_dir)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    (out,) = llm.chat(CONVERSATION, greedy, use_tqdm=False)
    assert out.prompt == hf.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    assert (
        out.prompt
        == "<s># system: You write Python.\n# user: Parse the config file.\n# assistant:\n\n"
    )
    want = hf.apply_chat_template(CONVERSATION, add_generation_prompt=True)["input_ids"]
    assert (
        out.prompt_token_ids
        == want
        == llm.get_tokenizer().apply_chat_template(
            CONVERSATION, add_generation_prompt=True, return_dict=False
        )
    )
    (plain,) = llm.generate([{"prompt_token_ids": want}], greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(out.outputs[0].text) > 0


def test_demo_serves_chat_completions_as_llm_chat_replies(llm):
    import httpx

    from jaxmamba.serve.api_server import ServerConfig

    from server_helpers import ServerThread

    greedy = SamplingParams(temperature=0, max_tokens=16)
    (want,) = llm.chat(CONVERSATION, greedy, use_tqdm=False)
    # Same weights and shapes as `llm`: the two share compiled steps.
    served = LLM(DEMO, params=llm.runner.params, max_num_seqs=2, max_model_len=256,
                 max_num_batched_tokens=64)  # fmt: skip
    server = ServerThread(served, ServerConfig(served_model_names=(DEMO,)))
    try:
        body = {"model": DEMO, "messages": CONVERSATION, "max_tokens": 16, "temperature": 0}
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    finally:
        server.stop()
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["message"]["content"] == want.outputs[0].text
    assert resp.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
