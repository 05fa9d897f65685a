"""Chat templates: a conversation rendered to prompt text with the tokenizer's Jinja template,
in the environment transformers' `apply_chat_template` gives it (sandboxed, `trim_blocks` and
`lstrip_blocks`, loop controls, `raise_exception`, `tojson`, `strftime_now`, the special tokens
by name, `{% generation %}` blocks rendered as their body)."""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


def render_chat(
    tokenizer: object,  # its `chat_template` and `special_tokens`, where it has them
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """`messages` ([{"role", "content"}, ...]) as the prompt text of `chat_template`, else of
    the tokenizer's own template (tokenizer_config.json `chat_template`). `kwargs` are the
    template's variables, as in transformers: `tools=[{"type": "function", "function":
    {...}}, ...]` is what a template renders the tools from."""
    template = _pick_template(
        chat_template or getattr(tokenizer, "chat_template", None), bool(kwargs.get("tools"))
    )
    if not isinstance(messages, list | tuple):
        raise TypeError(f"a conversation must be a list of message dicts, got {type(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
    specials = dict(getattr(tokenizer, "special_tokens", {}) or {})
    return _compile(template).render(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        **{"tools": None, "documents": None, **specials, **kwargs},
    )


def template_text(template: Any, *, tools: bool = False) -> str | None:
    """The template text of a tokenizer's `chat_template`: a string, or one of named ones
    ([{"name", "template"}, ...] in tokenizer_config.json): "tool_use" for a conversation with
    tools where there is one (as transformers picks), else "default"; None if none."""
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        template = template.get("tool_use" if tools and "tool_use" in template else "default")
    return template if isinstance(template, str) else None


def _pick_template(template: Any, tools: bool) -> str:
    template = template_text(template, tools=tools)
    if template is None:
        raise ValueError(
            "no chat template: the tokenizer's tokenizer_config.json has no chat_template "
            "(a string, or a 'default' among named ones); pass chat_template="
        )
    return template


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)
