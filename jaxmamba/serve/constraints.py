"""What a request constrains its output to (host side): OpenAI's `response_format`, vLLM's
`structured_outputs` and `guided_*` fields, and `tool_choice` "required" or a named function,
as one `StructuredOutputsParams`, checked here so that a bad one is a 400 before the request
reaches the engine. More than one constraint is a 400, as in vLLM.

`tool_choice` follows vLLM: a named function constrains the output to that function's
parameters schema (the output is the arguments); "required" to a JSON array of one or more
`{"name": ..., "parameters": ...}` objects, one shape per tool.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmamba.serve.protocol import ApiError, NamedToolChoice, Tool
from jaxmamba.structured.params import StructuredOutputsParams

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_FIELDS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init)
# Where a schema keeps its definitions, for `$ref: "#/$defs/..."` (2019-09 on) and
# `"#/definitions/..."` (draft 7).
_DEFINITIONS = ("$defs", "definitions")


def resolve_tool_choice(req) -> str | NamedToolChoice:
    """The request's tool choice, OpenAI's default filled in: "auto" with tools, else
    "none". A choice that names no tool, or tools that clash, are 400s."""
    choice = req.tool_choice
    if not req.tools:
        if choice is None or choice == "none":
            return "none"
        raise ApiError(400, f"tool_choice {_shown(choice)} needs tools, and the request has none",
                       param="tool_choice")  # fmt: skip
    names = [t.function.name for t in req.tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ApiError(400, f"tools[{i}]: a second function named {name!r}; names must "
                           "be unique", param="tools")  # fmt: skip
    if choice is None:
        return "auto"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ApiError(400, f"tool_choice names the function {choice.function.name!r}, which "
                       f"is not among the tools {names}", param="tool_choice")  # fmt: skip
    return choice


def _shown(choice) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"{{'type': 'function', 'function': {{'name': {choice.function.name!r}}}}}"
    return repr(choice)


def output_constraint(
    req, tool_choice: str | NamedToolChoice = "none"
) -> tuple[str, StructuredOutputsParams] | None:
    """The request field that constrains the output and its `StructuredOutputsParams`, validated
    (None if the output is free): a malformed schema, regex or grammar, a JSON-schema keyword
    the engine cannot enforce, or two constraints in one request are a 400 naming the
    problem."""
    # (the request's field, where in it, the params' fields)
    sources: list[tuple[str, str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        sources.append(("response_format", "response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(400, "response_format type 'json_schema' needs json_schema.schema, "
                           "the JSON schema of the output", param="response_format")  # fmt: skip
        schema = fmt.json_schema.schema_
        sources.append(("response_format", "response_format.json_schema.schema", {"json": schema}))
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - set(_FIELDS))
        if unknown:
            raise ApiError(400, f"structured_outputs has no field {unknown[0]!r} (its fields: "
                           f"{', '.join(_FIELDS)})", param="structured_outputs")  # fmt: skip
        sources.append(("structured_outputs", "structured_outputs", dict(req.structured_outputs)))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            sources.append((f"guided_{kind}", f"guided_{kind}", {kind: value}))
    tools = getattr(req, "tools", None)
    if tools and tool_choice == "required":
        schema = required_schema(tools, req.parallel_tool_calls)
        sources.append(("tool_choice", "tool_choice 'required'", {"json": schema}))
    elif tools and isinstance(tool_choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        schema = tool.function.parameters or _EMPTY_PARAMETERS
        sources.append(("tool_choice", "tool_choice", {"json": schema}))
    if not sources:
        return None
    if len(sources) > 1:
        names = [param for param, _, _ in sources]
        raise ApiError(400, f"a request takes one output constraint and this one has "
                       f"{len(names)}: {', '.join(names)}; give one", param=names[1])  # fmt: skip
    param, label, fields = sources[0]
    if param == "tool_choice":
        _check_tools(tools, tool_choice)
    return param, _checked(param, label, fields)


def _checked(param: str, label: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    from jaxmamba.structured.grammar import validate

    try:
        params = StructuredOutputsParams(**fields)
        validate(params)
    except (ValueError, TypeError) as err:
        message = str(err)
        if param != "structured_outputs":  # the params' name for the field is not the client's
            kind = next(iter(fields))
            engine_name = f"structured_outputs.{kind}"
            message = message.removeprefix(engine_name + ": ")
            if message.startswith(engine_name):
                message = label + message[len(engine_name) :]
            else:
                message = f"{label}: {message}"
        raise ApiError(400, message, param=param) from None
    return params


def _check_tools(tools: list[Tool], tool_choice) -> None:
    """Each constrained tool's parameters schema, checked on its own, so the 400 names it."""
    for i, tool in enumerate(tools):
        if isinstance(tool_choice, NamedToolChoice) and tool.function.name != (
            tool_choice.function.name
        ):
            continue
        label = f"tools[{i}].function.parameters"
        _checked("tools", label, {"json": tool.function.parameters or _EMPTY_PARAMETERS})


def required_schema(tools: list[Tool], parallel: bool = True) -> dict[str, Any]:
    """`tool_choice: "required"`: a JSON array of at least one (at most one unless
    `parallel`) `{"name": <a tool's name>, "parameters": <its parameters>}`. The tools'
    definitions (`$defs`) move to the top, where their `$ref`s point."""
    definitions: dict[str, dict[str, Any]] = {}
    shapes = []
    for i, tool in enumerate(tools):
        parameters = dict(tool.function.parameters or _EMPTY_PARAMETERS)
        for key in _DEFINITIONS:
            for name, schema in (parameters.pop(key, None) or {}).items():
                if definitions.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise ApiError(400, f"tools[{i}].function.parameters: {key} {name!r} differs "
                                   "from another tool's of that name; with tool_choice "
                                   "'required' the tools' definitions share one namespace",
                                   param="tools")  # fmt: skip
        shapes.append({
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": shapes}}
    if not parallel:
        schema["maxItems"] = 1
    return {**schema, **definitions}
