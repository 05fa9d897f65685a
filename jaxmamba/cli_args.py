"""Command-line flags generated from the settings dataclasses (`EngineConfig`, `RunConfig`):
one flag per field, `--field-name`, with the field's default and help text; a bool field is
`--name/--no-name`. The commands' own flags live with each command."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable

from jaxmamba.engine.config import EngineConfig, RunConfig

DEMO_MODEL = "nemotron-h-demo"
_GROUPS = {
    RunConfig: "how the model is loaded and run (LLM's keywords of the same names)",
    EngineConfig: "batch limits and the cache (LLM's keywords of the same names)",
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEMO_MODEL,
        help="preset name, YAML path, HF checkpoint directory or exported artifact (default: "
        f"{DEMO_MODEL}, the built-in model trained on Python's standard library)",
    )


def _base_type(hint) -> type:
    """`int` of `int | None`."""
    if isinstance(hint, types.UnionType):
        (hint,) = [t for t in typing.get_args(hint) if t is not type(None)]
    return hint


def add_setting_args(
    p: argparse.ArgumentParser, cls: type, names: Iterable[str] | None = None
) -> None:
    """A flag for each field of the settings dataclass `cls` (or of the fields in `names`)."""
    hints = typing.get_type_hints(cls)
    wanted = None if names is None else set(names)
    group = p.add_argument_group(f"{cls.__name__} settings", _GROUPS[cls])
    for f in dataclasses.fields(cls):
        if wanted is not None and f.name not in wanted:
            continue
        help_text = f.metadata["help"].replace("%", "%%")
        if f.default is not None:
            help_text += " (default: %(default)s)"
        kwargs = dict(default=f.default, help=help_text)
        if "parse" in f.metadata:  # a setting read from its own text (JSON)
            group.add_argument(flag_name(f.name), type=f.metadata["parse"], **kwargs)
            continue
        kind = _base_type(hints[f.name])
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = positive_int if f.metadata["positive"] else kind
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        group.add_argument(flag_name(f.name), **kwargs)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The flags of every `EngineConfig` field."""
    add_setting_args(p, EngineConfig)


def settings_from_args(args: argparse.Namespace, cls: type) -> dict:
    """The fields of `cls` among the parsed flags."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def llm_kwargs(args: argparse.Namespace) -> dict:
    """The `LLM(...)` keyword arguments of the parsed settings flags."""
    return {**settings_from_args(args, RunConfig), **settings_from_args(args, EngineConfig)}


def llm_from_args(args: argparse.Namespace):
    from jaxmamba.llm import LLM  # jax: loaded by the commands that build an engine

    return LLM(args.model, **llm_kwargs(args))
