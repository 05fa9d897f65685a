"""HF transformers (torch, CPU) as the oracle of generation: greedy decoding written out step by
step, each step a full forward over the prompt and the tokens so far (no cache), with vLLM's
rules for `logit_bias`, `min_tokens` and stop ids applied to the logits in plain torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def hf_model_of(params, cfg, path: Path):
    """The engine's parameters written by `save_hf_checkpoint` and loaded by transformers:
    the HF implementation of the same weights (float32, eval)."""
    from transformers import AutoModelForCausalLM

    from jaxmamba.model.loader import save_hf_checkpoint

    save_hf_checkpoint(params, cfg, path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_prompt_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, in float64."""
    logits = model(torch.tensor([ids])).logits[0].double()
    logprobs = torch.log_softmax(logits[:-1], -1)
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


@torch.no_grad()
def hf_greedy(
    model,
    prompt: list[int],
    max_tokens: int,
    *,
    logit_bias: dict[int, float] | None = None,
    stop_token_ids: tuple[int, ...] = (),
    eos_token_id: int | None = None,
    min_tokens: int = 0,
) -> tuple[list[int], str, float]:
    """(tokens, finish reason, smallest top-2 margin) of greedy decoding: `logit_bias` added
    to the logits; the stop ids (and eos, unless None) masked while fewer than `min_tokens`
    tokens exist; decoding ends at a stop id, which is kept as the last token. The margin
    tells a caller whether float32 rounding could flip a pick."""
    stops = set(stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
    tokens: list[int] = []
    margin = float("inf")
    for step in range(max_tokens):
        logits = model(torch.tensor([prompt + tokens])).logits[0, -1].double()
        for token, bias in (logit_bias or {}).items():
            logits[token] += bias
        if step < min_tokens and stops:
            logits[sorted(stops)] = -float("inf")
        top2 = torch.topk(logits, 2).values
        margin = min(margin, float(top2[0] - top2[1]))
        tokens.append(int(logits.argmax()))
        if tokens[-1] in stops:
            return tokens, "stop", margin
    return tokens, "length", margin
