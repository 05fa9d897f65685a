"""A chat model's tokenizer and chat templates for the tool-calling and reasoning tests: a
byte-level BPE (Qwen's and Nemotron's kind) built with `tokenizers`, whose added tokens are the
tags the templates use, and two Jinja templates written here, modeled on the published ones:

* `QWEN_TEMPLATE` (Qwen3.5, Qwen3-Coder): ChatML turns, the tools in `<tools>`, calls as
  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n
  </tool_call>` (the `qwen3_coder` format), the generation prompt opening `<think>\\n`, or
  writing an empty `<think>\\n\\n</think>\\n\\n` with `enable_thinking: false`.
* `NEMOTRON_TEMPLATE` (Nemotron Nano 2): the tools as JSON in `<AVAILABLE_TOOLS>`, calls as
  `<TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>` (`nemotron_json`), `/think` or
  `/no_think` in the system turn, and the generation prompt opening `<think>\\n` or writing an
  empty `<think></think>`.
"""

from __future__ import annotations

import json
from pathlib import Path

# ids 0-2 are the trainer's special tokens, so that the eos is id 2, as the random
# checkpoints of `hf_fixtures` have it.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen's tags are added tokens, but not special (decoding keeps them); Nemotron's are special.
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
SPECIAL_TAGS = ["<TOOLCALL>", "</TOOLCALL>"]
EOS_ID = 2

QWEN_TEMPLATE = """\
{%- set thinking = enable_thinking is not defined or enable_thinking %}
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou may call these functions:\\n<tools>' }}
    {%- for tool in tools %}
        {%- set f = tool.function if tool.function is defined else tool %}
        {{- '\\n<function>\\n<name>' ~ f.name ~ '</name>\\n<parameters>' }}
        {{- f.parameters | tojson }}
        {{- '</parameters>\\n</function>' }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function, reply with:\\n\\n<tool_call>\\n' }}
    {{- '<function=example_function_name>\\n<parameter=example_parameter>\\nvalue\\n' }}
    {{- '</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' ~ m.content }}
        {{- '\\n</tool_response><|im_end|>\\n' }}
    {%- elif m.role == "assistant" and m.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if m.content %}
            {{- '\\n' ~ m.content | trim ~ '\\n' }}
        {%- endif %}
        {%- for call in m.tool_calls %}
            {%- set call = call.function if call.function is defined else call %}
            {{- '\\n<tool_call>\\n<function=' ~ call.name ~ '>\\n' }}
            {%- for key, value in call.arguments | items %}
                {{- '<parameter=' ~ key ~ '>\\n' }}
                {%- if value is mapping or (value is sequence and value is not string) %}
                    {{- value | tojson }}
                {%- else %}
                    {{- value | string }}
                {%- endif %}
                {{- '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' ~ m.role ~ '\\n' ~ (m.content or '') ~ '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if thinking %}
        {{- '<think>\\n' }}
    {%- else %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

NEMOTRON_TEMPLATE = """\
{%- set thinking = enable_thinking is not defined or enable_thinking %}
{{- '<|im_start|>system\\n' ~ ('/think' if thinking else '/no_think') }}
{%- if tools %}
    {{- '\\n<AVAILABLE_TOOLS>[' }}
    {%- for tool in tools %}
        {{- tool | tojson }}
        {%- if not loop.last %}{{- ', ' }}{%- endif %}
    {%- endfor %}
    {{- ']</AVAILABLE_TOOLS>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for m in messages %}
    {%- if m.role == "tool" %}
        {{- '<|im_start|>user\\n<TOOL_RESPONSE>[' ~ m.content ~ ']</TOOL_RESPONSE><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' ~ m.role ~ '\\n' ~ (m.content or '') }}
        {%- if m.tool_calls %}
            {{- '<TOOLCALL>[' }}
            {%- for call in m.tool_calls %}
                {%- set call = call.function if call.function is defined else call %}
                {{- '{"name": ' ~ call.name | tojson ~ ', "arguments": ' }}
                {{- call.arguments | tojson ~ '}' }}
                {%- if not loop.last %}{{- ', ' }}{%- endif %}
            {%- endfor %}
            {{- ']</TOOLCALL>' }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' ~ ('<think>\\n' if thinking else '<think></think>') }}
{%- endif %}"""

_CORPUS = [
    "You may call these functions. To call a function, reply with the parameters.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}} {"a": 1, "b": 2}',
    "The weather in Paris is mild; let me think about the units and the city first.",
    "system user assistant tool function parameter value name parameters tools",
]


def write_chat_tokenizer(path: Path, template: str, vocab_size: int = 320) -> int:
    """A byte-level BPE tokenizer (GPT-2's pre-tokenizer and byte map, as Qwen's) with the
    templates' tags as added tokens, saved in `path` with `template` as its chat template;
    returns its size (ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 8, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TAGS])
    assert tok.token_to_id(SPECIAL[EOS_ID]) == EOS_ID
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": SPECIAL[EOS_ID], "pad_token": SPECIAL[0], "bos_token": None,
              "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def make_chat_checkpoint(path: Path, template: str, seed: int = 0) -> Path:
    """A random Nemotron-H checkpoint (`hf_fixtures`) with `write_chat_tokenizer`'s tokenizer
    and `template`."""
    from hf_fixtures import make_nemotron_h_checkpoint

    path, _ = make_nemotron_h_checkpoint(path, vocab_size=384, seed=seed)
    assert write_chat_tokenizer(path, template) <= 384
    return path
