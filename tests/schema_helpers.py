"""An independent JSON-schema checker for the structured-output tests: the keywords their
schemas use, written out by hand (`conforms`), and `assert_valid`, which also asks
`jsonschema_rs` (formats checked) where it is installed."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re


def _is_date(s: str) -> bool:
    try:
        return bool(re.fullmatch(r"\d{4}-\d{2}-\d{2}", s)) and bool(datetime.date.fromisoformat(s))
    except ValueError:
        return False


def _is_uuid(s: str) -> bool:
    return bool(re.fullmatch(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}", s))


def _is_ipv4(s: str) -> bool:
    try:
        ipaddress.IPv4Address(s)  # refuses leading zeros, as JSON Schema's ipv4 does
        return True
    except ValueError:
        return False


FORMATS = {"date": _is_date, "uuid": _is_uuid, "ipv4": _is_ipv4}
_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list}


def conforms(doc, schema: dict, root: dict | None = None) -> bool:
    """Whether `doc` satisfies `schema` (`root`: where its `$ref`s point, default itself):
    `$ref` into `$defs`, `anyOf`, `const`, `enum` (types compared: 1 is not True), the types
    with `minimum`/`maximum`, `minLength`/`maxLength`/`pattern`/`format` (date, uuid, ipv4),
    `items`/`minItems`/`maxItems`, `properties`/`required`/`additionalProperties: false`."""
    root = schema if root is None else root
    if "$ref" in schema:
        return conforms(doc, root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
    if "anyOf" in schema:
        return any(conforms(doc, s, root) for s in schema["anyOf"])
    if "const" in schema:
        return doc == schema["const"] and type(doc) is type(schema["const"])
    if "enum" in schema:
        return any(doc == v and type(doc) is type(v) for v in schema["enum"])
    t = schema["type"]
    if t == "integer":
        ok = isinstance(doc, int) and not isinstance(doc, bool)
    elif t == "number":
        ok = isinstance(doc, int | float) and not isinstance(doc, bool)
    else:
        ok = isinstance(doc, _TYPES[t])
    if not ok:
        return False
    if t in ("integer", "number"):
        return schema.get("minimum", -float("inf")) <= doc <= schema.get("maximum", float("inf"))
    if t == "string":
        if not schema.get("minLength", 0) <= len(doc) <= schema.get("maxLength", 10**9):
            return False
        if "pattern" in schema and not re.search(schema["pattern"], doc):
            return False
        return "format" not in schema or FORMATS[schema["format"]](doc)
    if t == "array":
        if not schema.get("minItems", 0) <= len(doc) <= schema.get("maxItems", 10**9):
            return False
        return all(conforms(x, schema["items"], root) for x in doc)
    if t == "object":
        props = schema.get("properties", {})
        if not set(schema.get("required", ())) <= set(doc):
            return False
        if schema.get("additionalProperties") is False and not set(doc) <= set(props):
            return False
        return all(conforms(v, props[k], root) for k, v in doc.items() if k in props)
    return True


def assert_valid(text: str, schema: dict) -> None:
    """`text` is JSON that satisfies `schema`, by `conforms` and by `jsonschema_rs`."""
    doc = json.loads(text)
    assert conforms(doc, schema), f"{text!r} does not conform to {schema}"
    try:
        import jsonschema_rs
    except ImportError:
        return
    v = jsonschema_rs.validator_for(schema, validate_formats=True)
    assert v.is_valid(doc), f"{text!r}: {[str(e) for e in v.iter_errors(doc)][:2]}"
