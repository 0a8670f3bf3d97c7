"""The `jaxserve` command line: serve, generate, chat, convert, bench."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from jaxserve.engine_args import EngineArgs


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", dest="sample_seed", type=int, default=None, help="seed of the sampling")
    c = g.add_mutually_exclusive_group()
    c.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="constrain the output to this JSON schema (its JSON text, or a file holding it)")
    c.add_argument("--regex", default=None, help="constrain the output to this regular expression")
    c.add_argument("--choice", action="append", default=None, help="the output is one of these (repeat)")


def json_schema_arg(value: str) -> dict:
    """A `--json-schema` value: the schema's JSON text, or a file holding it."""
    import json
    import os

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    try:
        return json.loads(value)
    except ValueError as e:
        raise SystemExit(f"--json-schema is neither a file nor JSON: {e}") from None


def _sampling_params(ns: argparse.Namespace):
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.structured_outputs import StructuredOutputsParams

    constraint = None
    if ns.json_schema is not None:
        constraint = StructuredOutputsParams(json=json_schema_arg(ns.json_schema))
    elif ns.regex is not None:
        constraint = StructuredOutputsParams(regex=ns.regex)
    elif ns.choice:
        constraint = StructuredOutputsParams(choice=ns.choice)
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          seed=ns.sample_seed, structured_outputs=constraint)


def _images(sources: list[str] | None) -> list[Any]:
    """`--image` values: local files (the user's own, read here) and URLs."""
    from jaxserve.images import load_image

    out = []
    for source in sources or []:
        if os.path.isfile(source):
            with open(source, "rb") as f:
                source = f.read()
        out.append(load_image(source))
    return out


def _cmd_generate(ns: argparse.Namespace) -> int:
    from jaxserve.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    images = _images(ns.image)
    prompts = [{"prompt": p, "multi_modal_data": {"image": images}} for p in ns.prompt] if images else ns.prompt
    outs = llm.generate(prompts, _sampling_params(ns), use_tqdm=False)
    for out in outs:
        print(out.outputs[0].text)
    return 0


def _cmd_chat(ns: argparse.Namespace) -> int:
    from jaxserve.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    params = _sampling_params(ns)
    images = _images(ns.image)  # go with the first message
    conversation: list[dict[str, Any]] = []
    if ns.system:
        conversation.append({"role": "system", "content": ns.system})
    messages = ns.message or []
    interactive = not messages
    while True:
        if interactive:
            try:
                text = input("> ")
            except EOFError:
                return 0
            if not text.strip():
                continue
        else:
            if not messages:
                return 0
            text = messages.pop(0)
        parts = [{"type": "image_pil", "image_pil": im} for im in images]
        conversation.append({"role": "user", "content": [*parts, {"type": "text", "text": text}] if parts else text})
        images = []
        reply = llm.chat([conversation], params, use_tqdm=False)[0].outputs[0].text
        conversation.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def _cmd_convert(ns: argparse.Namespace) -> int:
    from jaxserve.engine.model_loading import load_model
    from jaxserve.loader.export import export_hf

    if ns.config_only:
        from jaxserve.loader import checkpoint_tokenizer, open_checkpoint, resolve_model

        path = resolve_model(ns.model)
        ckpt = open_checkpoint(path, weights=False)
        export_hf(ns.to_hf, ckpt.config(), None, checkpoint_tokenizer(path, ckpt), dtype=ns.dtype)
        print(f"wrote the config and the tokenizer (no weights) to {ns.to_hf}")
        return 0
    loaded = load_model(EngineArgs(model=ns.model, dtype="float32"))
    if ns.calculate_kv_scales:
        import jax.numpy as jnp

        from jaxserve.engine.kv_scales import calculate_kv_scales

        loaded = calculate_kv_scales(loaded, jnp.float8_e4m3fn, page_size=16)
    files = export_hf(ns.to_hf, loaded.config, loaded.params, loaded.tokenizer, dtype=ns.dtype, vision=loaded.vision)
    print(f"wrote {len(files)} weight/config files and the tokenizer to {ns.to_hf}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve",
        description="jaxserve: serve large language models on JAX (OpenAI-compatible HTTP, Python API, "
                    "paged KV cache with prefix caching). Without a MODEL argument the bundled "
                    "SmolLM2-135M-Instruct is used.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="Serve MODEL over an OpenAI-compatible HTTP API with SSE streaming.")
    try:
        from server.cli import add_serve_args
    except ImportError:  # the server package is not installed
        add_serve_args = None
    if add_serve_args is not None:
        add_serve_args(serve)

    try:
        from router.cli import add_router_args, add_trace_args
    except ImportError:  # the router package is not installed
        add_router_args = add_trace_args = None
    if add_router_args is not None:
        add_router_args(sub.add_parser(
            "router", help="route requests over several workers (prefix- and load-aware, P/D)",
            description="An OpenAI-compatible front that picks a `jaxserve serve` worker per request."))
        add_trace_args(sub.add_parser(
            "trace", help="print a request's trace as a timeline",
            description="Fetch GET /v1/requests/ID/trace from a router or worker and print it."))

    gen = sub.add_parser("generate", help="complete a prompt and print the text",
                         description="Generate a completion of PROMPT (raw text, no chat template).")
    EngineArgs.add_cli_args(gen, with_model=False)
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument("--model", default=None, help="a GGUF file or HF directory (default: bundled SmolLM2)")
    gen.add_argument("--image", action="append", default=None, metavar="PATH_OR_URL",
                     help="an image for an image-text model (repeat for several): each prompt holds one placeholder "
                          "for each")
    _sampling_args(gen)

    chat = sub.add_parser("chat", help="chat with the model in the terminal",
                          description="Chat using the model's chat template; interactive unless --message is given.")
    EngineArgs.add_cli_args(chat, with_model=False)
    chat.add_argument("--model", default=None, help="a GGUF file or HF directory (default: bundled SmolLM2)")
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.add_argument("-m", "--message", action="append", help="a user message (repeat for several turns)")
    chat.add_argument("--image", action="append", default=None, metavar="PATH_OR_URL",
                      help="an image for an image-text model, sent with the first message (repeat for several)")
    _sampling_args(chat)

    conv = sub.add_parser("convert", help="write the served weights as an HF model directory",
                          description="Convert MODEL (GGUF or HF) to an HF directory: config.json, safetensors, "
                                      "tokenizer and chat template, with the weights jaxserve serves.")
    conv.add_argument("model", nargs="?", default=None, help="a GGUF file or HF directory (default: bundled)")
    conv.add_argument("--to-hf", required=True, metavar="DIR", help="output directory")
    conv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                      help="dtype of the written weights")
    conv.add_argument("--config-only", action="store_true",
                      help="write config.json and the tokenizer but no weights: a small directory that "
                           "`--load-format dummy` serves with random weights of the model's shapes")
    conv.add_argument("--calculate-kv-scales", action="store_true",
                      help="also write per-layer float8_e4m3 KV cache scales measured on built-in text "
                           "(`self_attn.k_scale` / `v_scale`, read by `serve --kv-cache-dtype fp8`)")
    bench = sub.add_parser("bench", help="benchmarks: offline throughput, serving load, comparisons",
                           description="Benchmark the engine offline, load any OpenAI-compatible server on "
                                       "this machine, or compare result files.")
    try:
        from bench.cli import add_bench_args
    except ImportError:  # the bench package is not installed
        add_bench_args = None
    if add_bench_args is not None:
        add_bench_args(bench)
    return parser


def dashed_flags(argv: list[str]) -> list[str]:
    """`argv` with each long flag's underscores as dashes (`--tokenizer_mode=mistral` -> `--tokenizer-mode=mistral`),
    as vLLM's parser takes them; values are left alone."""
    def dashed(arg: str) -> str:
        if not arg.startswith("--"):
            return arg
        name, eq, value = arg.partition("=")
        return name.replace("_", "-") + eq + value

    return [dashed(a) for a in argv]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(dashed_flags(sys.argv[1:] if argv is None else argv))
    if ns.command is None:
        parser.print_help()
        return 2
    if ns.command == "serve":
        from server.cli import run_serve

        return run_serve(ns)
    if ns.command in ("router", "trace"):
        from router.cli import run_router, run_trace

        return run_router(ns) if ns.command == "router" else run_trace(ns)
    if ns.command == "bench":
        from bench.cli import run_bench

        return run_bench(ns)
    handlers = {"generate": _cmd_generate, "chat": _cmd_chat, "convert": _cmd_convert}
    return handlers[ns.command](ns)


if __name__ == "__main__":
    sys.exit(main())
