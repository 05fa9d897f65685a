"""Request bodies of the OpenAI API (the fields this server implements, plus vLLM's sampling
and structured-output extensions), and the OpenAI error shape.

Types are checked strictly here (a string is not a number, `true` is not an int); unknown
top-level fields are rejected, as OpenAI's API rejects them. Value ranges are checked by
`SamplingParams`, whose messages reach the client unchanged.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's own cap on `n`.
MAX_N = 128
# Seeds are int64, as in vLLM.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ApiError(Exception):
    """A request the server answers with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    # `schema` would shadow a BaseModel attribute: the field has the alias instead.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # Every schema is enforced as written, strict or not (as in vLLM).
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON that validates against
    `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Strict):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    structured_outputs: dict[str, Any] | None = Field(
        None, description="StructuredOutputsParams' fields: json, regex, choice, grammar, "
        "json_object and the JSON options (vLLM)",
    )  # fmt: skip
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = Field(
        False, description="also return the prompt's and each choice's token ids (vLLM)"
    )
    prompt_logprobs: int | None = Field(
        None, description="the logprob of every prompt token and its top k (vLLM); not streamed"
    )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Messages may carry more than role and content (name, tool_calls, ...): the chat
    # template sees every field, as in transformers.
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        # An earlier turn's tool calls carry their arguments as JSON text (OpenAI's shape);
        # templates iterate them (`arguments|items`), so they get the object, as in vLLM.
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_arguments_as_object(call) for call in calls]
        return message


def _arguments_as_object(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = Field(
        True, description="with the server's --reasoning-parser: return the reasoning (vLLM)"
    )
    tools: list[Tool] | None = None
    # None: "auto" when there are tools, else "none" (OpenAI's default).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
