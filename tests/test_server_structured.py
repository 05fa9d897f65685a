"""Structured outputs and tool calling over HTTP, on the random-weight byte-level preset:
`response_format` (json_schema through the `openai` client's `parse`, json_object), vLLM's
`structured_outputs` and `guided_*` on both routes, each output checked against its schema /
regex / choices by an independent validator; bad constraints and two at once as 400s naming
the problem; `tools` with `tool_choice` named, "required" and "auto" as OpenAI `tool_calls`
whose arguments validate against the tool's parameters, streamed deltas reassembling to the
response sent whole; the tools rendered by the chat template. The tool-call parsers are checked
on hand-written outputs of every format, cut into random stream pieces."""

from __future__ import annotations

import functools
import json
import random
import re

import pytest
from pydantic import BaseModel, Field
from starlette.testclient import TestClient

from jaxmamba import LLM
from jaxmamba.serve.api_server import OpenAIServer, ServerConfig
from jaxmamba.serve.constraints import required_schema
from jaxmamba.serve.protocol import Tool
from jaxmamba.serve.tool_parsers import (
    TOOL_CALL_PARSERS,
    HermesParser,
    NamedToolCall,
    NemotronJsonParser,
    Qwen3CoderParser,
    RequiredToolCalls,
    detect_tool_call_parser,
    merge_deltas,
    parse_tool_calls,
    tool_call_tags,
)

from chat_fixtures import NEMOTRON_TEMPLATE, QWEN_TEMPLATE, write_chat_tokenizer
from schema_helpers import assert_valid, conforms
from server_helpers import call_args, reassembled, serving, sse_events

TINY = "nemotron-h-tiny"
ENGINE = dict(max_num_seqs=4, max_model_len=384, max_num_batched_tokens=32)
NAME = "tiny"
# A template that renders the tools and earlier calls, and teaches the hermes format.
TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }}"
    "({{ t.function.parameters.properties | list | join(',') }});{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "({{ c.function.arguments.city }})</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}"

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 5}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
# Its $ref points at the schema's root: "required" moves the definitions there.
PAINT = {
    "type": "object",
    "properties": {"color": {"$ref": "#/$defs/color"}},
    "required": ["color"],
    "additionalProperties": False,
    "$defs": {"color": {"enum": ["red", "blue"]}},
}
PARAMETERS = {"get_weather": WEATHER, "add": ADD, "paint": PAINT}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                           "parameters": schema}}
         for name, schema in PARAMETERS.items()]  # fmt: skip
USER = [{"role": "user", "content": "weather in Paris?"}]


# -- the tool-call parsers, on hand-written outputs ---------------------------------------------
def parse_in_pieces(new_parser, text: str, seed: int):
    """`parse_tool_calls`, but fed as a stream would feed it: random pieces of 1-6 chars."""
    rng, parser = random.Random(seed), new_parser()
    content, deltas, i = "", [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 6))
        piece, more = parser.feed(text[i:j])
        content, deltas, i = content + piece, deltas + more, j
    piece, more = parser.finish()
    calls = merge_deltas(deltas + more)
    content += piece
    return (None if calls and not content else content), calls


def calls_of(parsed) -> tuple:
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def weather_call(city: str) -> str:
    call = {"name": "get_weather", "arguments": {"city": city}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


TOOL_FUNCTIONS = [t["function"] for t in TOOLS]
PARSER_CASES = [
    # (case, parser, output, content, [(name, arguments)])
    ("hermes: text then two calls", HermesParser,
     "Let me look.\n" + weather_call("Paris") + "\n" + weather_call("Rome") + "\n",
     "Let me look.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("hermes: a call alone", HermesParser, weather_call("Oslo"), None,
     [("get_weather", {"city": "Oslo"})]),
    ("hermes: malformed JSON stays content", HermesParser,
     'Hi <tool_call>{"name": "f", "arguments": {"a": }}</tool_call> bye',
     'Hi <tool_call>{"name": "f", "arguments": {"a": }}</tool_call> bye', []),
    ("hermes: a good call, then a malformed one", HermesParser,
     weather_call("Nice") + " <tool_call>{oops</tool_call>\n", " <tool_call>{oops</tool_call>\n",
     [("get_weather", {"city": "Nice"})]),
    ("hermes: an unclosed last call (cut before its tag)", HermesParser,
     'ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', "ok",
     [("add", {"a": 1, "b": 2})]),
    ("hermes: text after the call", HermesParser, weather_call("Bern") + "\n\nDone. <",
     "\n\nDone. <", [("get_weather", {"city": "Bern"})]),
    ("hermes: no calls, whitespace kept", HermesParser, "a < b\n\n", "a < b\n\n", []),
    ("hermes: arguments as JSON text", HermesParser,
     '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>', None,
     [("add", {"a": 3, "b": 4})]),
    ("nemotron_json: text then two calls in one block", NemotronJsonParser,
     'Sure. <TOOLCALL>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
     '{"name": "paint", "arguments": {"color": "red"}}]</TOOLCALL>', "Sure.",
     [("add", {"a": 1, "b": 2}), ("paint", {"color": "red"})]),
    ("nemotron_json: malformed stays content", NemotronJsonParser,
     '<TOOLCALL>[{"name": "add", "arguments": {]</TOOLCALL>',
     '<TOOLCALL>[{"name": "add", "arguments": {]</TOOLCALL>', []),
    ("nemotron_json: an item without a name stays content", NemotronJsonParser,
     'x <TOOLCALL>[{"arguments": {}}]</TOOLCALL>', 'x <TOOLCALL>[{"arguments": {}}]</TOOLCALL>',
     []),
    ("qwen3_coder: typed parameters, text before", lambda: Qwen3CoderParser(TOOL_FUNCTIONS),
     "I'll add.\n<tool_call>\n<function=add>\n<parameter=a>\n12\n</parameter>\n"
     "<parameter=b>\n7\n</parameter>\n</function>\n</tool_call>", "I'll add.",
     [("add", {"a": 12, "b": 7})]),
    ("qwen3_coder: a string stays text, a missing </parameter> ends at the next",
     lambda: Qwen3CoderParser(TOOL_FUNCTIONS),
     "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n<parameter=unit>\nc\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=paint>\n"
     "<parameter=color>\nblue\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", {"city": "42", "unit": "c"}), ("paint", {"color": "blue"})]),
    ("qwen3_coder: not a function stays content", lambda: Qwen3CoderParser(TOOL_FUNCTIONS),
     "<tool_call>\nadd(1, 2)\n</tool_call>", "<tool_call>\nadd(1, 2)\n</tool_call>", []),
    ("required: two calls", RequiredToolCalls,
     '[{"name": "add", "parameters": {"a": 1, "b": 2}},\n {"name": "paint", "parameters": '
     '{"color": "blue"}}]', None, [("add", {"a": 1, "b": 2}), ("paint", {"color": "blue"})]),
    ("required: cut by max_tokens, the partial call is content", RequiredToolCalls,
     '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "pa',
     ' {"name": "pa', [("add", {"a": 1, "b": 2})]),
    ("named: the output is the arguments", lambda: NamedToolCall("add"), '{"a": 5, "b": 6}',
     None, [("add", {"a": 5, "b": 6})]),
]  # fmt: skip


@pytest.mark.parametrize("case,new_parser,text,content,calls", PARSER_CASES,
                         ids=[c[0] for c in PARSER_CASES])  # fmt: skip
def test_tool_call_parsers_read_hand_written_outputs_whole_and_in_pieces(
    case, new_parser, text, content, calls
):
    whole = calls_of(parse_tool_calls(new_parser(), text))
    assert whole == (content, calls)
    for seed in range(8):
        assert calls_of(parse_in_pieces(new_parser, text, seed)) == whole, seed


def test_call_ids_are_unique_and_openai_shaped():
    _, calls = parse_tool_calls(HermesParser(), weather_call("a") + weather_call("b"))
    assert len({c.id for c in calls}) == 2
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)


def test_the_tool_call_format_is_read_from_the_chat_template():
    qwen3 = '{{- "<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": ...}</tool_call>" }}'
    qwen35 = "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    nemotron = "{%- if tools %}<AVAILABLE_TOOLS>...{{ '<TOOLCALL>[' }}"
    assert detect_tool_call_parser(qwen3) == "hermes"
    assert detect_tool_call_parser(qwen35) == "qwen3_coder"
    assert detect_tool_call_parser(nemotron) == "nemotron_json"
    assert detect_tool_call_parser(PLAIN_TEMPLATE) is None
    assert detect_tool_call_parser(None) is None


def test_required_schema_moves_the_tools_definitions_to_its_root():
    schema = required_schema([Tool.model_validate(t) for t in TOOLS], parallel=False)
    assert schema["$defs"] == PAINT["$defs"] and schema["maxItems"] == 1
    doc = [{"name": "paint", "parameters": {"color": "red"}}]
    assert conforms(doc, schema)
    assert not conforms([{"name": "paint", "parameters": {"color": "green"}}], schema)
    assert not conforms([{"name": "add", "parameters": {"color": "red"}}], schema)


# -- the server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, **ENGINE)


@pytest.fixture(scope="module")
def served(llm):
    config = ServerConfig(served_model_names=(NAME,), chat_template=TEMPLATE,
                          enable_auto_tool_choice=True)  # fmt: skip
    with serving(llm, config) as (_, http, client):
        yield http, client


@pytest.fixture(scope="module")
def http(served):
    return served[0]


@pytest.fixture(scope="module")
def client(served):
    return served[1]


def post(http, route: str, body: dict) -> dict:
    r = http.post(f"/v1/{route}", json={"model": NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(http, route: str, body: dict) -> list:
    with http.stream("POST", f"/v1/{route}", json={"model": NAME, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


class Forecast(BaseModel):
    city: str = Field(max_length=5)
    days: int = Field(ge=1, le=14)
    unit: str = Field(pattern="^[cf]$")


def test_response_format_json_schema_parses_into_the_pydantic_model(client):
    resp = client.chat.completions.parse(
        model=NAME, messages=USER, response_format=Forecast, n=3, seed=0, max_tokens=200
    )
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        forecast = choice.message.parsed
        assert isinstance(forecast, Forecast), choice.message.content
        assert len(forecast.city) <= 5 and 1 <= forecast.days <= 14 and forecast.unit in "cf"


def test_json_object_and_schema_outputs_parse_on_both_routes(http):
    chat = post(http, "chat/completions", {"messages": USER, "max_tokens": 200, "n": 2, "seed": 1,
                                           "response_format": {"type": "json_object"}})  # fmt: skip
    for choice in chat["choices"]:
        assert choice["finish_reason"] == "stop"
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    completion = post(http, "completions", {"prompt": "JSON:", "max_tokens": 200, "n": 2,
                                            "seed": 2, "response_format": fmt})  # fmt: skip
    for choice in completion["choices"]:
        assert choice["finish_reason"] == "stop"
        assert_valid(choice["text"], WEATHER)


def test_vllm_fields_constrain_completions(http):
    regex = r"[a-f]{2,4}-[0-9]{1,3}"
    cases = [
        ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"guided_json": ADD}, lambda t: conforms(json.loads(t), ADD)),
        ({"structured_outputs": {"json": WEATHER, "disable_any_whitespace": True}},
         lambda t: conforms(json.loads(t), WEATHER) and not re.search(r"\s", t)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x\d\d?", t)),
    ]  # fmt: skip
    for field, check in cases:
        out = post(http, "completions", {"prompt": "go", "max_tokens": 120, "n": 2, "seed": 3,
                                         **field})  # fmt: skip
        for choice in out["choices"]:
            assert choice["finish_reason"] == "stop", (field, choice)
            assert check(choice["text"]), (field, choice["text"])


def test_streamed_constrained_output_is_the_whole_one(http):
    body = {"messages": USER, "max_tokens": 200, "seed": 4, "guided_json": WEATHER}
    whole = post(http, "chat/completions", body)["choices"][0]
    events = stream(http, "chat/completions", body)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == whole["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert_valid(text, WEATHER)


BAD = [
    # (case, route, body fields, param, words in the message)
    ("a keyword the engine cannot enforce", "chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {
         "name": "s", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ("json_schema without a schema", "completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
     "response_format", "needs json_schema.schema"),
    ("a malformed regex", "completions", {"guided_regex": "(ab"}, "guided_regex", "guided_regex"),
    ("a malformed grammar", "completions", {"structured_outputs": {"grammar": "root ::= ("}},
     "structured_outputs", "structured_outputs.grammar"),
    ("an unsatisfiable schema (found compiling)", "completions",
     {"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json", "json"),
    ("two constraints", "chat/completions",
     {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "response_format, guided_regex"),
    ("two kinds in structured_outputs", "completions",
     {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one constraint"),
    ("an unknown structured_outputs field", "completions",
     {"structured_outputs": {"jsn": {}}}, "structured_outputs", "no field 'jsn'"),
    ("tool_choice required and response_format", "chat/completions",
     {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format, tool_choice"),
    ("a tool's schema the engine cannot enforce", "chat/completions",
     {"tools": [*TOOLS, {"type": "function", "function": {"name": "bad", "parameters": {
         "type": "object", "not": {"required": ["x"]}}}}], "tool_choice": "required"},
     "tools", "tools[3].function.parameters"),
    ("a named function that is not a tool", "chat/completions",
     {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice", "'fly', which is not among the tools"),
    ("tool_choice without tools", "chat/completions", {"tool_choice": "required"},
     "tool_choice", "needs tools"),
    ("two tools of one name", "chat/completions", {"tools": [TOOLS[0], TOOLS[0]]}, "tools",
     "a second function named 'get_weather'"),
]  # fmt: skip


@pytest.mark.parametrize("case,route,fields,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_constraints_are_400s_naming_the_problem(http, case, route, fields, param, words):
    body = {"model": NAME, "max_tokens": 8, **fields}
    body.update({"messages": USER} if route == "chat/completions" else {"prompt": "x"})
    r = http.post(f"/v1/{route}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


def assert_stream_matches(http, body: dict, whole: list[dict]) -> None:
    streamed = reassembled(stream(http, "chat/completions", body))
    assert sorted(streamed) == [c["index"] for c in whole]
    for choice in whole:
        got = streamed[choice["index"]]
        assert call_args(got.tool_calls) == call_args(choice["message"].get("tool_calls") or [])
        assert (got.content or None) == choice["message"]["content"]
        assert got.finish_reason == choice["finish_reason"]
        assert all(c["id"].startswith("call_") for c in got.tool_calls)
        assert not got.reasoning and "reasoning_content" not in choice["message"]


def test_named_tool_choice_calls_that_function_with_valid_arguments(http):
    for name, schema in (("add", ADD), ("paint", PAINT)):
        choice = {"type": "function", "function": {"name": name}}
        body = {"messages": USER, "tools": TOOLS, "tool_choice": choice, "max_tokens": 200,
                "seed": 5, "n": 2}  # fmt: skip
        whole = post(http, "chat/completions", body)["choices"]
        for c in whole:
            calls = c["message"]["tool_calls"]
            assert c["message"]["content"] is None
            assert [call["function"]["name"] for call in calls] == [name]
            assert_valid(calls[0]["function"]["arguments"], schema)
            assert c["finish_reason"] == "stop"  # OpenAI's (and vLLM's) for a named function
        assert_stream_matches(http, body, whole)


def test_required_tool_choice_calls_tools_with_valid_arguments(http):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 250,
            "seed": 7, "n": 4, "parallel_tool_calls": False}  # fmt: skip
    whole = post(http, "chat/completions", body)["choices"]
    seen = set()
    for choice in whole:
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1 and choice["message"]["content"] is None
        for name, arguments in call_args(calls):
            assert conforms(arguments, PARAMETERS[name]), (name, arguments)
            seen.add(name)
    assert len(seen) >= 2, seen  # the anyOf lets the model pick
    assert_stream_matches(http, body, whole)


def test_auto_tool_choice_parses_the_hermes_format_with_content_before(http):
    # A random model writes no tool call by itself: a regex makes it write one in the format
    # the template teaches; "auto" constrains nothing, so the two combine.
    regex = (r'On it\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
             r'"[a-z]{1,5}", "unit": "[cf]"\}\}\n</tool_call>')  # fmt: skip
    body = {"messages": USER, "tools": TOOLS, "guided_regex": regex, "max_tokens": 120, "seed": 6}
    whole = post(http, "chat/completions", body)["choices"]
    assert whole[0]["message"]["content"] == "On it."
    [(name, arguments)] = call_args(whole[0]["message"]["tool_calls"])
    assert name == "get_weather" and conforms(arguments, WEATHER)
    assert whole[0]["finish_reason"] == "tool_calls"
    assert_stream_matches(http, body, whole)
    free = post(http, "chat/completions", {**body, "guided_regex": "[a-z ]{3,9}"})["choices"][0]
    assert "tool_calls" not in free["message"] and free["finish_reason"] == "stop"


def test_tools_and_earlier_calls_are_rendered_by_the_chat_template(http, llm):
    earlier = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}  # fmt: skip
    messages = [*USER, earlier, {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    body = {"messages": messages, "tools": TOOLS[:2], "tool_choice": "none", "max_tokens": 1,
            "return_token_ids": True}  # fmt: skip
    prompt = llm.tokenizer.decode(post(http, "chat/completions", body)["prompt_token_ids"])
    assert prompt.startswith("<|tools|>get_weather(city,unit);add(a,b);<|user|>")
    # The call's arguments reach the template as an object (the template reads .city).
    assert "<tool_call>get_weather(Oslo)</tool_call>" in prompt and "<|tool|>-3 C" in prompt


def test_auto_tool_choice_needs_the_flag_and_a_known_format(llm):
    """Servers that never start their engine: these requests are refused before it."""
    body = {"model": NAME, "messages": USER, "tools": TOOLS}
    hermes = ServerConfig(served_model_names=(NAME,), chat_template=TEMPLATE)
    r = TestClient(OpenAIServer(llm, hermes).app).post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    assert "'hermes' format" in r.json()["error"]["message"]
    plain = ServerConfig(served_model_names=(NAME,), chat_template=PLAIN_TEMPLATE)
    r = TestClient(OpenAIServer(llm, plain).app).post("/v1/chat/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tool_choice", err
    assert "teaches none this server knows (hermes, qwen3_coder, nemotron_json)" in err["message"]
    with pytest.raises(ValueError, match="no tool-call format"):
        OpenAIServer(llm, ServerConfig(served_model_names=(NAME,), chat_template=PLAIN_TEMPLATE,
                                       enable_auto_tool_choice=True))  # fmt: skip
    named = ServerConfig(served_model_names=(NAME,), chat_template=PLAIN_TEMPLATE,
                         tool_call_parser="nemotron_json")  # fmt: skip
    assert OpenAIServer(llm, named).tool_call_parser == "nemotron_json"


def test_serve_takes_vllms_tool_flags():
    from jaxmamba.cli import build_parser

    args = build_parser().parse_args(
        ["serve", TINY, "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]
    )
    assert args.enable_auto_tool_choice and args.tool_call_parser == "qwen3_coder"
    defaults = build_parser().parse_args(["serve", TINY])
    assert not defaults.enable_auto_tool_choice and defaults.tool_call_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", TINY, "--tool-call-parser", "llama3_json"])


# -- the formats, through the chat templates that teach them -------------------------------------
PLAN = {
    "type": "object",
    "properties": {"stops": {"type": "array", "items": {"type": "string"}},
                   "fast": {"type": "boolean"}, "budget": {"type": "number"},
                   "days": {"type": "integer"}, "meta": {"type": "object"},
                   "note": {"type": "string"}},
}  # fmt: skip
ROUND_TRIP_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "plan", "parameters": PLAN}}]
ROUND_TRIP_CALLS = [
    ("get_weather", {"city": "Paris", "unit": "c"}),
    ("plan", {"stops": ["Oslo", "Rome"], "fast": True, "budget": 2.5, "days": 3,
              "meta": {"k": [1, {"x": None}]}, "note": "12 o'clock, <b>"}),
    ("add", {"a": 12, "b": 7}),
]  # fmt: skip


@pytest.mark.parametrize("template,parser", [(QWEN_TEMPLATE, "qwen3_coder"),
                                             (NEMOTRON_TEMPLATE, "nemotron_json")])  # fmt: skip
def test_calls_the_chat_template_renders_parse_back_to_the_same_calls(template, parser, tmp_path):
    """An assistant turn with tool calls, rendered by a template modeled on the family's
    published one and tokenized by a byte-level BPE with its tags as added tokens, decoded as
    the server decodes an output, reads back to the same calls in the format the server detects
    from that template."""
    from tokenizers import Tokenizer

    from jaxmamba.chat import render_chat
    from jaxmamba.serve.protocol import ChatMessage

    assert detect_tool_call_parser(template) == parser
    write_chat_tokenizer(tmp_path, template)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": name, "arguments": json.dumps(arguments)}}
             for i, (name, arguments) in enumerate(ROUND_TRIP_CALLS)]  # fmt: skip
    messages = [*USER, {"role": "assistant", "content": "Sure.", "tool_calls": calls}]
    prompt = render_chat(None, [ChatMessage.model_validate(m).for_template() for m in messages],
                         chat_template=template, tools=ROUND_TRIP_TOOLS,
                         add_generation_prompt=False)  # fmt: skip
    head = "<|im_start|>assistant\n"
    turn = prompt[prompt.rindex(head) + len(head) :].split("<|im_end|>")[0]
    # The server shows special tokens exactly where the format's tags are special ones.
    specials = any(tok.token_to_id(tag) in special_ids(tok) for tag in tool_call_tags(parser))
    output = tok.decode(tok.encode(turn, add_special_tokens=False).ids,
                        skip_special_tokens=not specials)  # fmt: skip
    assert output == turn
    functions = [t["function"] for t in ROUND_TRIP_TOOLS]
    content, parsed = parse_tool_calls(TOOL_CALL_PARSERS[parser](functions), output)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == ROUND_TRIP_CALLS
    for seed in range(4):
        new_parser = functools.partial(TOOL_CALL_PARSERS[parser], functions)
        assert calls_of(parse_in_pieces(new_parser, output, seed)) == (content, ROUND_TRIP_CALLS)


def special_ids(tok) -> set[int]:
    return {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
