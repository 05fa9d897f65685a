"""`jaxmamba serve`: its flags, and the command (which imports the server lazily, so
`import jaxmamba` and the other subcommands never load FastAPI)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from jaxmamba.cli_args import (
    DEMO_MODEL,
    add_engine_args,
    add_model_arg,
    add_setting_args,
    llm_from_args,
)
from jaxmamba.engine.config import RunConfig
from jaxmamba.serve.reasoning_parsers import REASONING_PARSERS
from jaxmamba.serve.tool_parsers import TOOL_CALL_PARSERS


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (see docs/serving.md)")
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as --model gives it (vLLM's `vllm serve MODEL`)",
    )
    add_model_arg(p)
    add_setting_args(p, RunConfig)
    add_engine_args(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    p.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default: %(default)s)"
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", nargs="+",
                   help="model name(s) clients use (default: the model)")  # fmt: skip
    p.add_argument("--chat-template", help="a Jinja chat template (a file, or the template "
                   "itself) instead of the tokenizer's")  # fmt: skip
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default when a request has tools): read '
                   "tool calls out of the output, in --tool-call-parser's format "
                   "(vLLM's flag)")  # fmt: skip
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS),
                   help="the tool-call format the model writes (default: the one its chat "
                   "template teaches; docs/structured_outputs.md)")  # fmt: skip
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                   help="a thinking model's <think>...</think> goes to the chat completion's "
                   "reasoning_content, and constrained outputs start after it (vLLM's flag; "
                   "docs/structured_outputs.md)")  # fmt: skip
    p.add_argument(
        "--max-queued-requests",
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="sequences allowed to wait beyond --max-num-seqs; past that, 429 "
        "(default: %(default)s)",
    )
    p.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                   help="larger bodies get 413 (default: %(default)s)")  # fmt: skip
    p.add_argument("--shutdown-grace-s", type=int, default=30,
                   help="on SIGTERM, how long in-flight requests may run before they are "
                   "cancelled (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--log-level",
        default="info",
        help="debug, info, warning or error; the server's and the engine's (default: %(default)s)",
    )
    p.set_defaults(func=cmd_serve)
    return p


def _model(args) -> str:
    """The model of `serve MODEL` or `serve --model MODEL`."""
    if args.model_tag is None:
        return args.model
    if args.model not in (DEMO_MODEL, args.model_tag):
        raise ValueError(
            f"two models: {args.model_tag!r} (positional) and --model {args.model!r}; give one"
        )
    return args.model_tag


def cmd_serve(args) -> int:
    from jaxmamba.serve.api_server import ServerConfig, run_server

    args.model = _model(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    template = args.chat_template
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    llm = llm_from_args(args)
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name or [args.model]),
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        max_body_bytes=args.max_request_body_bytes,
        chat_template=template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    return run_server(llm, config, host=args.host, port=args.port, grace_s=args.shutdown_grace_s,
                      log_level=args.log_level)  # fmt: skip
