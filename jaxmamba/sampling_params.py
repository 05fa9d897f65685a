"""How to sample one request, with vLLM's names and semantics; validated on construction.

Host-side only: every field is checked for its exact type (a `bool` is not an int, a float
must be finite, token ids are ints) and range, and the error names the field, what it
expected, and what it got.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from jaxmamba.step_contract import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_IDS
from jaxmamba.structured.params import StructuredOutputsParams

# Fields that are declared and validated but whose non-default values nothing acts on yet;
# setting one raises instead of being silently ignored. Whoever implements a field removes it.
NOT_IMPLEMENTED: frozenset[str] = frozenset()


def _int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value}")
    return value


def _float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float, got {value}")
    return value


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _in_range(name: str, value: float, ok: bool, expected: str) -> float:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's names). `temperature=0` is greedy.

    Applied on device in vLLM's order: logit_bias and min_tokens masking, then the
    repetition/frequency/presence penalties, temperature, top-k, top-p over the top-k
    survivors renormalised, and min-p. `top_k` 0 or -1 is off (stored as 0).
    `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar
    (docs/structured_outputs.md): its token mask applies after the penalties and before the
    temperature; logprobs stay the raw model's.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: Mapping[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        s = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        s("n", _int("n", self.n, low=1))
        s("presence_penalty", _float("presence_penalty", self.presence_penalty))
        s("frequency_penalty", _float("frequency_penalty", self.frequency_penalty))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _in_range(name, value, -2.0 <= value <= 2.0, "in [-2, 2]")
        rp = _float("repetition_penalty", self.repetition_penalty)
        s("repetition_penalty", _in_range("repetition_penalty", rp, rp > 0, "> 0"))
        t = _float("temperature", self.temperature)
        s("temperature", _in_range("temperature", t, t >= 0, ">= 0 (0 = greedy)"))
        p = _float("top_p", self.top_p)
        s("top_p", _in_range("top_p", p, 0 < p <= 1, "in (0, 1]"))
        k = _int("top_k", self.top_k)
        if k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive int, got {k}")
        s("top_k", max(k, 0))
        mp = _float("min_p", self.min_p)
        s("min_p", _in_range("min_p", mp, 0 <= mp <= 1, "in [0, 1]"))
        if self.seed is not None:
            s("seed", _int("seed", self.seed))
        s("stop", self._stop_strings(self.stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TypeError(f"stop_token_ids must be a list of ints, got {type(ids).__name__}")
        s("stop_token_ids", tuple(_int("stop_token_ids[]", t, low=0) for t in ids))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            s(name, _bool(name, getattr(self, name)))
        if self.max_tokens is not None:
            s("max_tokens", _int("max_tokens", self.max_tokens, low=1))
        s("min_tokens", _int("min_tokens", self.min_tokens, low=0))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > "
                f"max_tokens={self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                s(name, _int(name, getattr(self, name), low=0, high=MAX_LOGPROBS))
        s("logit_bias", self._logit_bias(self.logit_bias))
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
            )
        if self.min_tokens > 0 and len(self.stop_token_ids) > MAX_STOP_IDS - 1:
            raise ValueError(
                f"with min_tokens, stop_token_ids holds at most {MAX_STOP_IDS - 1} ids (the "
                f"eos ids share {MAX_STOP_IDS} slots), got {len(self.stop_token_ids)}"
            )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise TypeError(
                f"structured_outputs must be a StructuredOutputsParams (from jaxmamba import "
                f"StructuredOutputsParams), got {so!r} ({type(so).__name__})"
            )
        self._reject_unimplemented()

    @staticmethod
    def _stop_strings(stop) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, Sequence):
            raise TypeError(f"stop must be a str or a list of str, got {type(stop).__name__}")
        for item in stop:
            if not isinstance(item, str):
                raise TypeError(f"stop must hold str, got {item!r} ({type(item).__name__})")
            if not item:
                raise ValueError("stop strings must be non-empty, got ''")
        return tuple(stop)

    @staticmethod
    def _logit_bias(bias) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise TypeError(
                f"logit_bias must be a dict of token id -> float, got {type(bias).__name__}"
            )
        return {
            _int("logit_bias key", k, low=0): _float(f"logit_bias[{k!r}]", v)
            for k, v in bias.items()
        }

    def _reject_unimplemented(self) -> None:
        default = {f.name: f.default for f in fields(self)}
        default["stop"], default["logit_bias"] = (), None
        for name in sorted(NOT_IMPLEMENTED):
            value = getattr(self, name)
            if name == "max_tokens":
                if value is None:
                    raise NotImplementedError(
                        "max_tokens=None (up to max_model_len) is not supported yet; pass an int"
                    )
            elif value != default[name] and not (name == "logit_bias" and not value):
                raise NotImplementedError(
                    f"SamplingParams.{name}={value!r} is not supported yet "
                    f"(only the default {default[name]!r})"
                )
