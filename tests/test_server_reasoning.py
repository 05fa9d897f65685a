"""Reasoning outputs (the server's `--reasoning-parser`, vLLM's): the parsers on hand-written
outputs, whole and cut into random stream pieces; where a completion starts (inside the
reasoning, or past it when the generation prompt closed it or thinking is off); and a server on
a random checkpoint whose byte-level BPE has `<think>` and `</think>` as tokens and whose chat
template is Qwen3.5's kind (`chat_fixtures`): `message.reasoning_content` through the `openai`
client, streamed deltas that reassemble to the response sent whole, a constraint that starts
where the reasoning ends, `enable_thinking: false`, and tool calls read from the content after
the reasoning only."""

from __future__ import annotations

import random

import pytest

from jaxmamba import LLM
from jaxmamba.serve.api_server import ServerConfig
from jaxmamba.serve.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    split_reasoning,
)

from chat_fixtures import NEMOTRON_TEMPLATE, QWEN_TEMPLATE, make_chat_checkpoint
from schema_helpers import assert_valid
from server_helpers import call_args, reassembled, serving, sse_events

NAME = "thinker"
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
        "</tool_call>")  # fmt: skip
PARSER_CASES = [
    # (case, parser, in_reasoning, output, reasoning, content)
    ("the prompt opened the reasoning", Qwen3ReasoningParser, True,
     "Let me think.\n</think>\n\nIt is 4.", "Let me think.\n", "\n\nIt is 4."),
    ("the model writes <think> itself", DeepSeekR1ReasoningParser, True,
     "\n<think>hmm</think>ok", "hmm", "ok"),
    ("no end: all reasoning (cut short)", Qwen3ReasoningParser, True, "still <thin", "still <thin",
     None),
    ("an end tag alone", DeepSeekR1ReasoningParser, True, "</think>", None, None),
    ("a second <think> is reasoning text", Qwen3ReasoningParser, True,
     "<think>a <think> b</think>c", "a <think> b", "c"),
    ("past the reasoning already: all content", Qwen3ReasoningParser, False,
     "x</think>y", None, "x</think>y"),
    ("qwen3: a call inside the thinking ends it", Qwen3ReasoningParser, True,
     "I'll call it.\n" + CALL, "I'll call it.\n", CALL),
    ("qwen3: a call tag without a function stays reasoning", Qwen3ReasoningParser, True,
     "the <tool_call> tag</think>done", "the <tool_call> tag", "done"),
    ("deepseek_r1: a call inside the thinking is reasoning", DeepSeekR1ReasoningParser, True,
     "I'll call it.\n" + CALL, "I'll call it.\n" + CALL, None),
]  # fmt: skip


def split_in_pieces(parser, text: str, seed: int) -> tuple[str | None, str | None]:
    """`split_reasoning`, fed as a stream would feed it: random pieces of 1-5 chars."""
    rng, reasoning, content, i = random.Random(seed), "", "", 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 5))
        r, c = parser.feed(text[i:j])
        reasoning, content, i = reasoning + r, content + c, j
    r, c = parser.finish()
    return (reasoning + r) or None, (content + c) or None


@pytest.mark.parametrize("case,cls,in_reasoning,text,reasoning,content", PARSER_CASES,
                         ids=[c[0] for c in PARSER_CASES])  # fmt: skip
def test_reasoning_parsers_split_outputs_whole_and_in_pieces(
    case, cls, in_reasoning, text, reasoning, content
):
    assert split_reasoning(cls(in_reasoning=in_reasoning), text) == (reasoning, content)
    for seed in range(8):
        assert split_in_pieces(cls(in_reasoning=in_reasoning), text, seed) == (reasoning, content)


@pytest.mark.parametrize("template", [QWEN_TEMPLATE, NEMOTRON_TEMPLATE])
def test_a_completion_starts_in_the_reasoning_unless_the_prompt_closed_it(template):
    from jaxmamba.chat import render_chat

    messages = [{"role": "user", "content": "hi"}]

    def generation_prompt(**kwargs) -> str:
        whole = render_chat(None, messages, chat_template=template, **kwargs)
        turns = render_chat(None, messages, chat_template=template, add_generation_prompt=False,
                            **kwargs)  # fmt: skip
        return whole[len(turns) :]

    for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser):
        assert cls.starts_in_reasoning(generation_prompt(), {})
        off = {"enable_thinking": False}
        assert not cls.starts_in_reasoning(generation_prompt(**off), off)
        # No tag in the generation prompt: the model opens its reasoning itself (Qwen3's older
        # templates), unless the request turned thinking off and the parser honours that.
        assert cls.starts_in_reasoning("<|im_start|>assistant\n", off) == (
            cls is DeepSeekR1ReasoningParser
        )


# -- the server -------------------------------------------------------------------------------
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
                   "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
USER = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_chat_checkpoint(tmp_path_factory.mktemp("thinker"), QWEN_TEMPLATE, seed=1)
    return LLM(str(path), max_num_seqs=4, max_model_len=640, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def served(llm):
    config = ServerConfig(served_model_names=(NAME,), reasoning_parser="qwen3",
                          enable_auto_tool_choice=True)  # fmt: skip
    with serving(llm, config) as (server, http, client):
        yield server, http, client


@pytest.fixture(scope="module")
def end_id(llm) -> int:
    [token] = llm.tokenizer.encode("</think>", add_special_tokens=False)
    return token


def chat(served, body: dict, *, stream: bool = False):
    _, http, _ = served
    body = {"model": NAME, "messages": USER, "max_tokens": 120, "seed": 0, **body}
    if not stream:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return reassembled(sse_events(r.iter_lines()))


def assert_stream_matches(served, body: dict, whole: dict) -> None:
    streamed = chat(served, body, stream=True)
    for choice in whole["choices"]:
        got, message = streamed[choice["index"]], choice["message"]
        assert (got.reasoning or None) == message["reasoning_content"] == message["reasoning"]
        assert (got.content or None) == message["content"]
        assert call_args(got.tool_calls) == call_args(message.get("tool_calls") or [])
        assert got.finish_reason == choice["finish_reason"]


def test_the_constraint_starts_where_the_reasoning_ends(served, end_id):
    """A random model writes `</think>` soon when it is favoured (logit_bias); the JSON after
    it is constrained, the reasoning before it is not (vLLM's `enable_in_reasoning` off)."""
    _, _, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    extra = {"logit_bias": {str(end_id): 4.0}, "seed": 3}
    resp = client.chat.completions.create(model=NAME, messages=USER, response_format=fmt, n=3,
                                          max_tokens=200, extra_body=extra)  # fmt: skip
    thought = 0
    for choice in resp.choices:
        message = choice.message
        assert choice.finish_reason == "stop", message
        assert message.reasoning_content == message.reasoning
        assert "</think>" not in (message.reasoning_content or "")
        thought += bool(message.reasoning_content)
        assert_valid(message.content, WEATHER)
    assert thought, "no choice reasoned before its answer"
    body = {"response_format": fmt, "n": 3, "max_tokens": 200, **extra}
    assert_stream_matches(served, body, chat(served, body))


def test_without_the_reasoning_end_the_output_is_all_reasoning(served):
    whole = chat(served, {"guided_regex": "[a-z]{3}", "max_tokens": 12})
    message = whole["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"], message
    assert whole["choices"][0]["finish_reason"] == "length"  # the constraint never started
    hidden = chat(served, {"max_tokens": 12, "include_reasoning": False})["choices"][0]
    assert hidden["message"]["reasoning_content"] is None and hidden["message"]["content"] is None


def test_enable_thinking_false_constrains_from_the_first_token(served, llm):
    body = {"chat_template_kwargs": {"enable_thinking": False}, "guided_json": WEATHER,
            "max_tokens": 200, "return_token_ids": True, "n": 2}  # fmt: skip
    whole = chat(served, body)
    assert llm.tokenizer.decode(whole["prompt_token_ids"]).endswith("<think>\n\n</think>\n\n")
    for choice in whole["choices"]:
        assert choice["message"]["reasoning_content"] is None
        assert choice["finish_reason"] == "stop"
        assert_valid(choice["message"]["content"], WEATHER)
    assert_stream_matches(served, {k: v for k, v in body.items() if k != "return_token_ids"},
                          whole)  # fmt: skip


def test_tool_calls_are_read_from_the_content_after_the_reasoning(served, end_id):
    # The template teaches qwen3_coder's format; a regex (which starts after the reasoning)
    # makes the random model write a call in it.
    assert served[0].server.tool_call_parser == "qwen3_coder"
    regex = (r"<tool_call>\n<function=get_weather>\n<parameter=city>\n[a-z]{1,8}\n</parameter>\n"
             r"<parameter=days>\n[1-9]\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
    body = {"tools": TOOLS, "guided_regex": regex, "logit_bias": {str(end_id): 4.0},
            "max_tokens": 200, "seed": 5}  # fmt: skip
    whole = chat(served, body)
    choice = whole["choices"][0]
    [(name, arguments)] = call_args(choice["message"]["tool_calls"])
    assert name == "get_weather" and isinstance(arguments["days"], int), arguments
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] is not None
    assert_stream_matches(served, body, whole)


def test_serve_takes_the_reasoning_parser_flag():
    from jaxmamba.cli import build_parser

    args = build_parser().parse_args(["serve", "nemotron-h-tiny", "--reasoning-parser", "qwen3"])
    assert args.reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "nemotron-h-tiny", "--reasoning-parser", "glm45"])
