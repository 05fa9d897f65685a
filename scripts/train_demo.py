"""Train the built-in demo model (`configs/nemotron-h-demo/`) on the Python standard library.

    python scripts/train_demo.py                          # the shipped run: ~5 min on one H200
    python scripts/train_demo.py --smoke --out /tmp/demo  # a toy model, 3 steps, ~15 s on CPU
    python scripts/train_demo.py --draft                  # its draft model (speculative decoding)

On the GPU machine, `python3 -m pip install --no-deps --no-build-isolation -e .` first.

The model is the engine's own `Mamba2HybridLM` with the plain-jnp reference kernels
(`impl="ref"`, differentiable), run as a one-row prefill step vmapped over the batch, so the
trained weights are exactly what `jaxmamba.LLM` serves. Text: every `*.py` file of the running
interpreter's standard library (PSF License) outside test suites, sorted by path; every 20th
file is held out. Each file is `<s> bytes </s>`; a training row is a window of the
concatenated training files at an offset drawn from the seed, so a run is reproducible from
`--seed` (init and data order). The output directory holds config.json, model.safetensors
(matrices bf16), tokenizer.json, tokenizer_config.json and README.md.

`--draft` trains `configs/nemotron-h-demo-draft/` instead: a much smaller model on the same
tokenizer, data, split and loop, for `speculative_config={"method": "draft_model", "model":
"nemotron-h-demo-draft"}` with the demo model as the target. Besides its own held-out bits per
byte it scores its top-1 agreement with the target on the held-out windows (the share of
positions where both argmaxes agree: a greedy draft's acceptance rate on that text).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmamba.config import ModelConfig
from jaxmamba.engine.batch import Bucket, RowSpec, StepBuilder
from jaxmamba.model.cache import CacheSpec, init_cache
from jaxmamba.model.families import load_config
from jaxmamba.model.loader import checkpoint_param_shapes, save_hf_checkpoint
from jaxmamba.model.metadata import ForwardMetadata
from jaxmamba.model.model import Mamba2HybridLM
from jaxmamba.model.params import init_params
from jaxmamba.model.weights import load_params

BOS, EOS, PAD = 256, 257, 258
HELD_OUT_EVERY = 20
# Path parts that mark test suites and installed packages, not the library itself.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
SAMPLE_PROMPTS = ("def main(", "import ")


def _nemotron_h(name: str, pattern: str, **sizes) -> ModelConfig:
    """A Nemotron-H config over the byte vocabulary; `pattern` in HF's M/*/- letters."""
    layer = {"M": "mamba", "*": "attention", "-": "mlp"}
    return ModelConfig(
        model_type="nemotron_h", name=name, vocab_size=272,
        layer_types=tuple(layer[c] for c in pattern),
        norm_eps=1e-5, tie_word_embeddings=False, conv_kernel=4, use_conv_bias=True,
        mamba_proj_bias=False, time_step_limit=(0.001, math.inf), residual_in_fp32=False,
        attention_bias=False, mlp_bias=False, mlp_activation="relu2",
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **sizes,
    )  # fmt: skip


DEMO_CONFIG = _nemotron_h(
    "nemotron-h-demo", "M-M*M-M-M*M-",
    hidden_size=256, mamba_num_heads=8, mamba_head_dim=64, n_groups=1, ssm_state_size=32,
    chunk_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
    intermediate_size=448,
)  # fmt: skip
SMOKE_CONFIG = _nemotron_h(
    "nemotron-h-demo-smoke", "M*-",
    hidden_size=32, mamba_num_heads=2, mamba_head_dim=16, n_groups=1, ssm_state_size=8,
    chunk_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    intermediate_size=32,
)  # fmt: skip
# The draft proposes k tokens with k + 1 forwards of itself per verify step, so what counts is
# its cost per forward against the target's: 3 layers against 12 (one Mamba2 layer to carry
# the recent bytes, one attention layer to look back, one MLP), at half the width.
DRAFT_CONFIG = _nemotron_h(
    "nemotron-h-demo-draft", "M*-",
    hidden_size=128, mamba_num_heads=4, mamba_head_dim=64, n_groups=1, ssm_state_size=32,
    chunk_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
    intermediate_size=384,
)  # fmt: skip


# ----------------------------------------------------------------------------------------
# data (host)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """Every `*.py` under `root` outside test suites, sorted by relative path."""
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if EXCLUDED_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if p.is_file():
            files.append(rel)
    return [root / rel for rel in sorted(files, key=lambda r: r.as_posix())]


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, held-out): every `HELD_OUT_EVERY`-th file by sorted path is held out."""
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return train, held


def encode_documents(files: list[Path]) -> np.ndarray:
    """`<s> bytes </s>` per file, concatenated: int32[n]."""
    parts = []
    for f in files:
        parts += [np.array([BOS], np.int32), np.frombuffer(f.read_bytes(), np.uint8), [EOS]]
    return np.concatenate(parts).astype(np.int32)


def eval_windows(stream: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows of `seq_len` targets: tokens int32[W, L+1] and a target mask
    bool[W, L] that is true where the target is a byte (the last window padded)."""
    num = -(-(len(stream) - 1) // seq_len)
    padded = np.full(num * seq_len + 1, PAD, np.int32)
    padded[: len(stream)] = stream
    idx = np.arange(num)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    tokens = padded[idx]
    return tokens, tokens[:, 1:] < 256


# ----------------------------------------------------------------------------------------
# model (device)


def one_row_step(cfg: ModelConfig, seq_len: int, page_size: int):
    """A fresh cache and the metadata of a prefill step of one `seq_len`-token row."""
    pages = -(-seq_len // page_size)
    spec = CacheSpec(num_slots=1, num_pages=pages, page_size=page_size)
    builder = StepBuilder(spec, pages, cfg.vocab_size, cfg.chunk_size)
    row = RowSpec(tokens=[0] * seq_len, prefix_len=0, state_slot=0, pages=list(range(pages)))
    inputs = builder.build([row], Bucket(seq_len, 1, 0))
    meta = functools.partial(
        ForwardMetadata.build, inputs, num_decode=0, chunk_size=cfg.chunk_size,
        page_size=page_size, pad_page=spec.pad_page, pad_slot=spec.pad_slot,
    )  # fmt: skip
    return spec, meta


def make_logits_fn(cfg: ModelConfig, seq_len: int, dtype, page_size: int = 64):
    """`logits(params, ids i32[B, L]) -> f32[B, L, V]`: one prefill step per row, vmapped.

    Params are cast to the leaf dtypes a `dtype` model declares (norms, A_log, D, dt_bias stay
    float32), so float32 master weights train a bf16 model.
    """
    model = Mamba2HybridLM(cfg, jnp.dtype(dtype), impl="ref")
    spec, meta_fn = one_row_step(cfg, seq_len, page_size)
    leaf_dtypes = jax.tree.map(lambda s: s.dtype, checkpoint_param_shapes(cfg, dtype))

    def logits(params, ids):
        params = jax.tree.map(lambda p, d: p.astype(d), params, leaf_dtypes)
        cache, meta = init_cache(cfg, spec, jnp.dtype(dtype)), meta_fn()

        def row(row_ids):
            out, _ = model.apply(
                {"params": params}, row_ids, cache, meta, method=Mamba2HybridLM.forward_logits
            )
            return out

        return jax.vmap(row)(ids)

    return logits


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross-entropy in nats: f32[B, L]."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    return logz - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def make_train_step(logits_fn, optimizer, batch_size: int, seq_len: int, key: jax.Array):
    def loss_fn(params, tokens):  # tokens i32[B, L+1]
        return jnp.mean(cross_entropy(logits_fn(params, tokens[:, :-1]), tokens[:, 1:]))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, stream, step):
        # The batch is drawn on device from the seed and the step: no host data per step.
        starts = jax.random.randint(
            jax.random.fold_in(key, step), (batch_size,), 0, stream.shape[0] - seq_len - 1
        )
        tokens = stream[starts[:, None] + jnp.arange(seq_len + 1)[None, :]]
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def make_optimizer(steps: int, lr: float, warmup: int) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, min(warmup, max(steps - 1, 1)), max(steps, 2), end_value=lr * 0.1
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask),
    )


def sum_over_windows(fn, tokens: np.ndarray, mask: np.ndarray, batch: int) -> float:
    """The sum of `fn(tokens i32[b, L+1], mask bool[b, L]) -> f32[]` over the windows,
    `batch` at a time."""
    total = 0.0
    for i in range(0, len(tokens), batch):
        t, m = tokens[i : i + batch], mask[i : i + batch]
        if len(t) < batch:  # pad the last batch with masked windows (one shape, one compile)
            t = np.concatenate([t, np.full((batch - len(t), t.shape[1]), PAD, np.int32)])
            m = np.concatenate([m, np.zeros((batch - len(m), m.shape[1]), bool)])
        total += float(fn(t, m))
    return total


def held_out_bpb(logits_fn, params, tokens: np.ndarray, mask: np.ndarray, batch: int) -> float:
    """Bits per byte over the byte targets of the held-out windows."""

    @jax.jit
    def nats(params, tokens, mask):
        ce = cross_entropy(logits_fn(params, tokens[:, :-1]), tokens[:, 1:])
        return jnp.sum(jnp.where(mask, ce, 0.0))

    total = sum_over_windows(lambda t, m: nats(params, t, m), tokens, mask, batch)
    return total / math.log(2) / max(int(mask.sum()), 1)


def held_out_agreement(draft_fn, draft_params, target_fn, target_params, tokens: np.ndarray,
                       mask: np.ndarray, batch: int) -> float:  # fmt: skip
    """The share of byte-target positions of the held-out windows where the draft's argmax is
    the target's: what a greedy draft's acceptance would be on that text."""

    @jax.jit
    def agree(draft_params, target_params, tokens, mask):
        draft = jnp.argmax(draft_fn(draft_params, tokens[:, :-1]), axis=-1)
        target = jnp.argmax(target_fn(target_params, tokens[:, :-1]), axis=-1)
        return jnp.sum(mask & (draft == target))

    fn = lambda t, m: agree(draft_params, target_params, t, m)  # noqa: E731
    return sum_over_windows(fn, tokens, mask, batch) / max(int(mask.sum()), 1)


def stored_params(params, cfg: ModelConfig):
    """`params` rounded to the checkpoint's dtypes (bf16 matrices, float32 vectors)."""
    dtypes = jax.tree.map(lambda s: s.dtype, checkpoint_param_shapes(cfg, jnp.bfloat16))
    return jax.tree.map(lambda p, d: jnp.asarray(p, d), params, dtypes)


def count_params(params) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


# ----------------------------------------------------------------------------------------
# output directory (host)


# The vocabulary has no role tokens (the model saw only Python source): roles are comment lines.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}# {{ message['role'] }}: "
    "{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n\n{% endif %}"
)


def write_tokenizer(out: Path, cfg: ModelConfig) -> None:
    """tokenizer.json whose ids are the UTF-8 byte values, then <s>, </s>, <pad>, and unused
    specials up to the model's vocab; its post-processor prepends <s> as the training rows
    do; plus tokenizer_config.json naming bos/eos/pad and the chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to one printable character; ids follow the byte values.
    byte_char = {b: _byte_level_char(b) for b in range(256)}
    assert set(byte_char.values()) == set(alphabet)
    vocab = {byte_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"] + [f"<unused{i}>" for i in range(cfg.vocab_size - 259)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert [tok.token_to_id(s) for s in specials[:3]] == [BOS, EOS, PAD]
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": True,
                "model_max_length": 2048,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )


def _byte_level_char(b: int) -> str:
    """GPT-2's byte-to-character map, which the ByteLevel pre-tokenizer applies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


README_TITLE = """\
# nemotron-h-demo

A small Nemotron-H hybrid (Mamba2 + attention + MLP layers, {params:,} parameters) with a
byte-level vocabulary, trained by `scripts/train_demo.py` so that `jaxmamba generate` prints
readable text out of the box. It writes Python-like code and knows nothing else.
"""
DRAFT_README_TITLE = """\
# nemotron-h-demo-draft

The draft model of `nemotron-h-demo` for speculative decoding: a much smaller Nemotron-H hybrid
({params:,} parameters) on the same byte vocabulary and tokenizer, trained by
`scripts/train_demo.py --draft` on the same data, split and schedule.

    LLM("nemotron-h-demo", speculative_config={{"method": "draft_model",
        "model": "nemotron-h-demo-draft", "num_speculative_tokens": 4}})
"""
README = """
* Layers ({layers}): `{pattern}` (M Mamba2, * attention, - MLP); hidden {hidden}; Mamba2
  {mamba_heads} heads x {mamba_head_dim}, state {state}, groups {groups}, chunk {chunk};
  attention {q_heads} query / {kv_heads} KV heads x {head_dim}; MLP {mlp} (relu²).
* Vocabulary: ids 0..255 are UTF-8 bytes, 256 `<s>`, 257 `</s>`, 258 `<pad>`, 259..{last}
  unused (`tokenizer.json` maps them so).
* Chat template (`tokenizer_config.json`): `<s>`, then each message as a
  line `# <role>: <content>`, then `# assistant:` and a blank line.
* Data: the `*.py` sources of the Python {python} standard library ({source}), test
  suites excluded: {train_files} files ({train_mb:.1f} MB) for training; every {every}th file
  by sorted path ({held_files} files, {held_mb:.2f} MB) held out. The Python standard library is
  distributed under the Python Software Foundation License Version 2 (PSF-2.0), which
  permits redistribution and derived works; these weights are derived from it.
* Training: {steps} steps of {batch} x {seq_len} tokens, AdamW (peak lr {lr}), seed {seed};
  {wall:.0f} s of training (compile included) on {machine}, {date}.
* Held-out loss: **{bpb:.3f} bits per byte** (the weights as stored here, float32 compute).
{agreement_line}
Retrain (writes this directory again; the data are the standard library of the Python that
runs it, so the same files need the same Python build):

    {command}
"""


AGREEMENT_LINE = """\
* Top-1 agreement with `{target}` on the held-out windows: **{agreement:.1%}** of byte
  positions (both models as stored, float32 compute): a greedy draft's acceptance on that text.
"""


def write_readme(out: Path, info: dict) -> None:
    cfg = {c.name: c for c in (DEMO_CONFIG, SMOKE_CONFIG, DRAFT_CONFIG)}[info["config"]]
    letters = {"mamba": "M", "attention": "*", "mlp": "-"}
    title = (DRAFT_README_TITLE if cfg is DRAFT_CONFIG else README_TITLE).format(**info)
    agreement = AGREEMENT_LINE.format(**info) if info.get("agreement") is not None else ""
    text = title + README.format(
        layers=cfg.num_layers,
        pattern="".join(letters[t] for t in cfg.layer_types), hidden=cfg.hidden_size,
        mamba_heads=cfg.mamba_num_heads, mamba_head_dim=cfg.mamba_head_dim,
        state=cfg.ssm_state_size, groups=cfg.n_groups, chunk=cfg.chunk_size,
        q_heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, mlp=cfg.intermediate_size, last=cfg.vocab_size - 1,
        every=HELD_OUT_EVERY, agreement_line=agreement, **info,
    )  # fmt: skip
    (out / "README.md").write_text(text)


# ----------------------------------------------------------------------------------------
# main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output directory (default: configs/"
                   f"{DEMO_CONFIG.name}, with --draft configs/{DRAFT_CONFIG.name})")  # fmt: skip
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=128, help="rows per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="compute dtype of training (master weights are float32)")  # fmt: skip
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--eval-windows", type=int, default=None,
                   help="score only the first N held-out windows (default: all)")  # fmt: skip
    p.add_argument("--source", type=Path, default=None,
                   help="folder of *.py files (default: the standard library)")  # fmt: skip
    p.add_argument("--draft", action="store_true",
                   help=f"train the draft model {DRAFT_CONFIG.name} of {DEMO_CONFIG.name} "
                        "(speculative decoding)")  # fmt: skip
    p.add_argument("--smoke", action="store_true",
                   help="a toy model (with --draft: the draft's own), 3 steps of 4 x 64 tokens: "
                        "the script end to end")  # fmt: skip
    p.add_argument("--no-samples", action="store_true", help="skip the greedy samples at the end")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.batch_size, args.seq_len = min(args.steps, 3), 4, 64
        args.eval_batch, args.log_every, args.warmup = 4, 1, 1
        args.eval_windows = args.eval_windows or 8
    args.out = args.out or f"configs/{(DRAFT_CONFIG if args.draft else DEMO_CONFIG).name}"
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    if args.draft:
        return DRAFT_CONFIG  # small enough to run as it is in a smoke run
    return SMOKE_CONFIG if args.smoke else DEMO_CONFIG


def retrain_command(args: argparse.Namespace) -> str:
    """The command line that trains the same weights: the flags that differ from the
    defaults, leaving out those that change only what is printed."""
    modes = [f"--{m}" for m in ("draft", "smoke") if getattr(args, m)]
    defaults = parse_args(modes)
    words = ["python", "scripts/train_demo.py"]
    for name, value in vars(args).items():
        if name in ("log_every", "no_samples", "eval_batch") or value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return " ".join(words + modes)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = model_config(args)
    out = Path(args.out)
    root = args.source or stdlib_dir()
    files = source_files(root)
    train_files, held_files = split_files(files)
    if not train_files or not held_files:
        raise SystemExit(
            f"need at least {HELD_OUT_EVERY} source files under {root}, found {len(files)}"
        )
    train, held = encode_documents(train_files), encode_documents(held_files)
    print(f"data: {len(files)} files under {root} (Python {platform.python_version()}): "
          f"train {len(train_files)} files {len(train):,} tokens, held-out {len(held_files)} "
          f"files {len(held):,} tokens", flush=True)  # fmt: skip

    key = jax.random.PRNGKey(args.seed)
    init_key, data_key = jax.random.split(key)
    params = init_params(cfg, jnp.float32, seed=int(jax.random.randint(init_key, (), 0, 2**31 - 1)))
    n_params = count_params(params)
    print(f"model: {cfg.name} {n_params:,} params, layers {cfg.layer_types}", flush=True)

    logits_fn = make_logits_fn(cfg, args.seq_len, args.dtype)
    optimizer = make_optimizer(args.steps, args.lr, args.warmup)
    opt_state = optimizer.init(params)
    train_step = make_train_step(logits_fn, optimizer, args.batch_size, args.seq_len, data_key)
    stream = jax.device_put(train)
    tokens_per_step = args.batch_size * args.seq_len

    start = last_time = time.perf_counter()
    losses = []
    for step in range(args.steps):
        params, opt_state, loss = train_step(params, opt_state, stream, jnp.int32(step))
        losses.append(loss)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean = float(jnp.mean(jnp.stack(losses)))  # the one host sync per log interval
            now = time.perf_counter()
            rate = len(losses) * tokens_per_step / (now - last_time)
            print(f"step {step + 1:5d}  loss {mean:.4f} nats/token ({mean / math.log(2):.3f} "
                  f"bits)  {rate:,.0f} tokens/s  {now - start:.0f} s", flush=True)  # fmt: skip
            losses, last_time = [], now
    wall = time.perf_counter() - start

    shipped = stored_params(params, cfg)
    eval_fn = make_logits_fn(cfg, args.seq_len, jnp.float32)
    tokens, mask = eval_windows(held, args.seq_len)
    tokens, mask = tokens[: args.eval_windows], mask[: args.eval_windows]
    bpb = held_out_bpb(eval_fn, shipped, tokens, mask, args.eval_batch)
    print(f"held-out: {bpb:.4f} bits per byte over {int(mask.sum()):,} bytes", flush=True)
    agreement = None
    if args.draft:
        target_cfg = load_config(DEMO_CONFIG.name)
        target = load_params(DEMO_CONFIG.name, target_cfg, jnp.float32, 0)
        target_fn = make_logits_fn(target_cfg, args.seq_len, jnp.float32)
        agreement = held_out_agreement(eval_fn, shipped, target_fn, target, tokens, mask,
                                       args.eval_batch)  # fmt: skip
        print(f"held-out: top-1 agreement with {DEMO_CONFIG.name} {agreement:.1%}", flush=True)

    save_hf_checkpoint(jax.device_get(shipped), cfg, out)
    write_tokenizer(out, cfg)
    info = dict(
        config=cfg.name, params=n_params, python=platform.python_version(), source=str(root),
        train_files=len(train_files), held_files=len(held_files),
        train_mb=sum(f.stat().st_size for f in train_files) / 1e6,
        held_mb=sum(f.stat().st_size for f in held_files) / 1e6,
        steps=args.steps, batch=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        seed=args.seed, wall=wall, bpb=bpb, command=retrain_command(args),
        target=DEMO_CONFIG.name if args.draft else None, agreement=agreement,
        machine=f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        date=datetime.date.today().isoformat(),
    )  # fmt: skip
    write_readme(out, info)
    print("wrote", out, json.dumps(info), flush=True)

    if not args.no_samples:
        (speculative_samples if args.draft else greedy_samples)(out)
    return 0


SAMPLE_ENGINE = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=64)


def greedy_samples(out: Path) -> None:
    from jaxmamba import LLM, SamplingParams

    llm = LLM(str(out), **SAMPLE_ENGINE)
    outs = llm.generate(list(SAMPLE_PROMPTS), SamplingParams(temperature=0, max_tokens=64))
    for prompt, o in zip(SAMPLE_PROMPTS, outs, strict=True):
        print(f"--- greedy sample: {prompt!r}\n{prompt}{o.outputs[0].text}", flush=True)


def speculative_samples(out: Path, k: int = 4) -> None:
    """The target's greedy samples without and with the draft at `out`: the same text, and
    the draft's acceptance on it."""
    from jaxmamba import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=64)
    spec = {"method": "draft_model", "model": str(out), "num_speculative_tokens": k}
    plain = LLM(DEMO_CONFIG.name, **SAMPLE_ENGINE).generate(list(SAMPLE_PROMPTS), greedy)
    llm = LLM(DEMO_CONFIG.name, speculative_config=spec, **SAMPLE_ENGINE)
    drafted = llm.generate(list(SAMPLE_PROMPTS), greedy)
    for prompt, a, b in zip(SAMPLE_PROMPTS, plain, drafted, strict=True):
        same = a.outputs[0].token_ids == b.outputs[0].token_ids
        print(f"--- greedy sample with the draft (k={k}), identical to the target alone: {same}"
              f"\n{prompt}{b.outputs[0].text}", flush=True)  # fmt: skip
    stats = llm.stats()
    print(f"acceptance {stats['spec_acceptance_rate']:.3f} over {stats['spec_verify_steps']} "
          "verify steps", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
