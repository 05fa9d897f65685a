"""What a request's output must look like: vLLM's `StructuredOutputsParams`, validated on
construction (host side; imports no grammar engine).

Exactly one constraint: `json` (a JSON schema), `regex`, `choice`, `grammar` (GBNF/EBNF or
Lark), `json_object=True` (any JSON object) or `structural_tag`. The options shape JSON:
`disable_any_whitespace` (no whitespace between tokens), `disable_additional_properties`
(objects that do not say otherwise get `additionalProperties: false`), `whitespace_pattern`
(a regex for the whitespace allowed). Whether a schema, regex or grammar is one the engine
can enforce is checked when it is compiled (`jaxmamba.structured.grammar`).

`reasoning_end_ids` is jaxmamba's, not a vLLM request field: the constraint starts after the
output writes these tokens (a reasoning model's end-of-thinking tag; the server's
`--reasoning-parser` sets it, as vLLM's structured outputs start where the reasoning ends).
"""

from __future__ import annotations

import json as _json
from collections.abc import Sequence
from dataclasses import dataclass, field

# The constraint fields, in vLLM's order.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One structured-output constraint (vLLM's fields and rules): exactly one of the
    constraint fields is set (not None); `SamplingParams(structured_outputs=...)` carries it."""

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # The constraint applies from just after these tokens (empty: from the first token).
    reasoning_end_ids: Sequence[int] = ()
    # (kind, canonical text, options): what the compiled grammar is cached by.
    _key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            what = "none is" if not given else f"{len(given)} are: {', '.join(given)}"
            raise ValueError(
                f"structured outputs take exactly one constraint of {', '.join(KINDS)}; {what} set"
            )
        kind = given[0]
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str):
                raise TypeError(
                    f"whitespace_pattern must be a str, got {type(self.whitespace_pattern)}"
                )
            if self.disable_any_whitespace:
                raise ValueError(
                    "whitespace_pattern and disable_any_whitespace=True contradict each other; "
                    "set one"
                )
        ids = self.reasoning_end_ids
        if (
            isinstance(ids, str | bytes)
            or not isinstance(ids, Sequence)
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        ):
            raise TypeError(f"reasoning_end_ids must be a list of token ids, got {ids!r}")
        object.__setattr__(self, "reasoning_end_ids", tuple(ids))
        text = getattr(self, f"_{kind}_text")()
        options = (
            self.disable_any_whitespace,
            self.disable_additional_properties,
            self.whitespace_pattern,
            self.reasoning_end_ids,
        )
        object.__setattr__(self, "_key", (kind, text, options))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `KINDS`."""
        return self._key[0]

    @property
    def key(self) -> tuple[str, str, tuple]:
        """(kind, text, options): equal keys compile to the same grammar. `text` is the
        constraint as canonical text (a schema re-serialised, choices as a JSON list)."""
        return self._key

    def _json_text(self) -> str:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = _json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        elif hasattr(schema, "model_json_schema"):  # a pydantic model class, as vLLM takes
            schema = schema.model_json_schema()
        if not isinstance(schema, dict | bool):
            raise TypeError(
                f"structured_outputs.json must be a JSON schema (a dict, or its JSON text), "
                f"got {type(schema).__name__}"
            )
        try:
            return _json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json is not JSON-serialisable: {e}") from None

    def _regex_text(self) -> str:
        return self._nonempty_str("regex")

    def _grammar_text(self) -> str:
        return self._nonempty_str("grammar")

    def _structural_tag_text(self) -> str:
        raise ValueError(
            "structured_outputs.structural_tag is not supported yet; use json, regex, choice, "
            "grammar or json_object"
        )

    def _choice_text(self) -> str:
        choice = self.choice
        if isinstance(choice, str | bytes) or not isinstance(choice, Sequence):
            raise TypeError(
                f"structured_outputs.choice must be a list of str, got {type(choice).__name__}"
            )
        if not choice:
            raise ValueError("structured_outputs.choice must hold at least one string, got []")
        for c in choice:
            if not isinstance(c, str):
                raise TypeError(
                    f"structured_outputs.choice must hold str, got {c!r} ({type(c).__name__})"
                )
        return _json.dumps(list(choice), ensure_ascii=False)

    def _json_object_text(self) -> str:
        if self.json_object is not True:
            raise ValueError(
                f"structured_outputs.json_object must be True when set (None: off), got "
                f"{self.json_object!r}"
            )
        return ""

    def _nonempty_str(self, name: str) -> str:
        value = getattr(self, name)
        if not isinstance(value, str):
            raise TypeError(f"structured_outputs.{name} must be a str, got {type(value).__name__}")
        if not value:
            raise ValueError(f"structured_outputs.{name} must be non-empty, got ''")
        return value
