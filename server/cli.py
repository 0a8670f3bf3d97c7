"""`jaxserve serve`: the flags and the entry point (dispatched to by the top-level `jaxserve` command)."""

from __future__ import annotations

import argparse
import json
import logging

from jaxserve.chat_template import load_chat_template
from jaxserve.engine_args import EngineArgs
from server.config import ServerConfig
from server.reasoning import REASONING_PARSERS
from server.tool_parsers import PARSERS


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine's flags and the server's to `parser`."""
    EngineArgs.add_cli_args(parser)
    d = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address to listen on (0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=d.port, help="TCP port (0 picks a free one)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on the API routes (health, ready and "
                        "metrics stay open)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients may send as 'model' (the first is reported); default: the "
                        "model's own name")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    g.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="past this many requests waiting for the engine, new ones get 429 with Retry-After")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="larger request bodies are refused with 413")
    g.add_argument("--log-level", default=d.log_level,
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="level of the server's logs (one access-log line per request at info)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) used instead of the model's")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests give their own chat_template (rendered in Jinja's sandbox; refused without)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto': the model chooses between text and tool calls, which "
                        "--tool-call-parser finds in its replies")
    g.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="the format the model writes tool calls in (see server/tool_parsers.py)")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="return a thinking model's reasoning in 'reasoning' apart from its answer "
                        "(see server/reasoning.py)")
    g.add_argument("--responses-store-capacity", type=int, default=d.responses_store_capacity,
                   help="/v1/responses answers kept in memory for previous_response_id and GET /v1/responses/{id} "
                        "(the newest ones; 0 keeps none)")
    g.add_argument("--allowed-origins", type=_json_list, default=list(d.allowed_origins), metavar="JSON",
                   help='CORS: origins browsers may call from (a JSON list; default ["*"])')
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--allowed-methods", type=_json_list, default=list(d.allowed_methods), metavar="JSON",
                   help='CORS: allowed methods (a JSON list; default ["*"])')
    g.add_argument("--allowed-headers", type=_json_list, default=list(d.allowed_headers), metavar="JSON",
                   help='CORS: allowed headers (a JSON list; default ["*"])')
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM) ...")
    g.add_argument("--ssl-certfile", default=None, help="... and this certificate (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="over HTTPS, ask clients for certificates these CAs signed")
    g.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under (e.g. /llm)")
    g.add_argument("--default-chat-template-kwargs", default={}, metavar="JSON",
                   help='what every chat\'s template gets, under a request\'s own chat_template_kwargs, e.g. '
                        '\'{"enable_thinking": false}\'')
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs\' tokens as "token_id:N" unless a request says otherwise')
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="taken for vLLM's commands: usage always reports prompt_tokens_details.cached_tokens")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt and sampling parameters as it is submitted")
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="log no request's prompt (the default; vLLM's older flag)")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="log each request's outputs as it finishes")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="at most this many characters of text (and token ids) in each logged prompt and output")
    g.add_argument("--role", choices=["both", "prefill", "decode"], default="both",
                   help="part in disaggregated serving: both (aggregated), prefill (computes prompts and "
                        "hands their KV over) or decode (imports the KV and generates); see server/pd.py")
    return parser


def server_config_from_args(ns: argparse.Namespace) -> ServerConfig:
    """The `ServerConfig` the parsed flags describe."""
    return ServerConfig(host=ns.host, port=ns.port, api_key=ns.api_key,
                        served_model_names=tuple(ns.served_model_name or ()),
                        shutdown_timeout=ns.shutdown_timeout, max_waiting_requests=ns.max_waiting_requests,
                        max_request_body_bytes=ns.max_request_body_bytes, log_level=ns.log_level,
                        chat_template=None if ns.chat_template is None else load_chat_template(ns.chat_template),
                        trust_request_chat_template=ns.trust_request_chat_template,
                        enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser,
                        reasoning_parser=ns.reasoning_parser, responses_store_capacity=ns.responses_store_capacity,
                        allowed_origins=ns.allowed_origins, allow_credentials=ns.allow_credentials,
                        allowed_methods=ns.allowed_methods, allowed_headers=ns.allowed_headers,
                        ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile, ssl_ca_certs=ns.ssl_ca_certs,
                        root_path=ns.root_path, default_chat_template_kwargs=ns.default_chat_template_kwargs,
                        return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
                        enable_log_requests=ns.enable_log_requests, enable_log_outputs=ns.enable_log_outputs,
                        max_log_len=ns.max_log_len)


def _json_list(value: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form for the CORS flags)."""
    try:
        got = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}") from e
    if not isinstance(got, list) or not all(isinstance(x, str) for x in got):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return got


def setup_logging(level: str) -> None:
    """Plain one-line records on stderr for jaxserve's loggers."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxserve").setLevel(level.upper())


def run_serve(ns: argparse.Namespace) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, and return the exit code."""
    from jaxserve.loader import model_display_name, resolve_model
    from server.runner import run_server
    from server.state import LoadingEngine

    log = logging.getLogger("jaxserve.server")
    try:
        config = server_config_from_args(ns)
    except (ValueError, OSError) as e:  # a bad chat template or tool-parser setting
        setup_logging(ns.log_level)
        log.error("%s", e)
        return 2
    setup_logging(config.log_level)
    args = EngineArgs.from_cli_args(ns)
    try:
        path = resolve_model(args.model)
    except FileNotFoundError as e:
        log.error("%s", e)
        return 2
    if args.num_processes > 1 and (args.data_parallel_size > 1 or ns.role != "both"):
        log.error("several processes serve one lock-step engine: --data-parallel-size and --role are not "
                  "supported with --num-processes > 1")
        return 2
    if args.num_processes > 1 and args.process_id != 0:
        # Process 0 serves HTTP and decides every step; the others replay its steps on their devices.
        from sharding.distributed import run_follower

        return run_follower(args)

    lockstep = []

    def load():
        if args.data_parallel_size > 1:
            from sharding.data_parallel import DataParallelEngine

            engine = DataParallelEngine.from_engine_args(args)
        elif args.num_processes > 1:
            from sharding.distributed import LockstepAsyncEngine

            engine = LockstepAsyncEngine.from_engine_args(args)
            lockstep.append(engine.engine)
        else:
            from jaxserve.engine.async_engine import AsyncEngine

            engine = AsyncEngine.from_engine_args(args)
        engine.pd_role = ns.role  # read by the worker's P/D endpoints (server/pd.py)
        return engine

    placeholder = LoadingEngine(model_display_name(path), args.max_model_len or 0)
    code = run_server(config, load, placeholder)
    if lockstep and lockstep[0].stopped:
        from sharding.distributed import shutdown_distributed

        # The engine thread has told the followers to stop; leave the cluster with them. (Without an
        # engine that stopped them, the followers notice the coordinator is gone and exit on their own.)
        shutdown_distributed()
    return code


def main(argv: list[str] | None = None) -> int:
    """`python -m server`: the same as `jaxserve serve`."""
    parser = argparse.ArgumentParser(prog="jaxserve serve",
                                     description="Serve a model over an OpenAI-compatible HTTP API.")
    add_serve_args(parser)
    return run_serve(parser.parse_args(argv))
