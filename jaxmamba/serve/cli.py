"""`jaxmamba serve`: its flags, and the command (which imports the server lazily, so
`import jaxmamba` and the other subcommands never load FastAPI)."""

from __future__ import annotations

import argparse
import inspect
import logging
from pathlib import Path


def add_parser(sub, add_model_args, add_engine_args) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (see docs/serving.md)")
    add_model_args(p)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", nargs="+",
                   help="model name(s) clients use (default: --model)")  # fmt: skip
    p.add_argument("--chat-template", help="a Jinja chat template (a file, or the template "
                   "itself) instead of the tokenizer's")  # fmt: skip
    p.add_argument(
        "--max-queued-requests",
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="sequences allowed to wait beyond --max-num-seqs; past that, 429",
    )
    p.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                   help="larger bodies get 413")  # fmt: skip
    p.add_argument("--shutdown-grace-s", type=int, default=30,
                   help="on SIGTERM, how long in-flight requests may run before they are "
                   "cancelled")  # fmt: skip
    # Engine flags the shared engine-argument group may not (yet) define.
    _add_missing(p, "--max-prefill-seqs", type=int)
    _add_missing(p, "--page-size", type=int)
    _add_missing(p, "--num-state-slots", type=int)
    _add_missing(p, "--num-pages", type=int)
    _add_missing(p, "--no-enable-prefix-caching", dest="enable_prefix_caching",
                 action="store_false", default=None)  # fmt: skip
    p.add_argument(
        "--precompile",
        action="store_true",
        help="compile every step bucket before serving (no compile under load)",
    )
    if "--compilation-cache-dir" not in p._option_string_actions:
        from jaxmamba.export.cli import add_cache_args

        add_cache_args(p)
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_serve)
    return p


def _add_missing(p: argparse.ArgumentParser, flag: str, **kwargs) -> None:
    if flag not in p._option_string_actions:
        p.add_argument(flag, **kwargs)


def llm_from_args(args):
    """An LLM from every parsed flag named like one of LLM's keyword arguments."""
    from jaxmamba import LLM

    names = inspect.signature(LLM.__init__).parameters
    kwargs = {k: v for k, v in vars(args).items() if k in names and k != "model" and v is not None}
    return LLM(args.model, **kwargs)


def cmd_serve(args) -> int:
    from jaxmamba.serve.api_server import ServerConfig, run_server

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
    )
    return run_server(llm, config, host=args.host, port=args.port, grace_s=args.shutdown_grace_s,
                      log_level=args.log_level)  # fmt: skip
