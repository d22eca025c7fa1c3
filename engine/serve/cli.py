"""`berth serve MODEL_DIR`: the OpenAI-compatible server for one model.

Loads the engine, listens, prints where, and on SIGTERM stops admitting (new requests get
503 + Retry-After, /ready 503), lets in-flight requests finish for up to --shutdown-timeout
seconds (then aborts them: they end with finish_reason "abort"), and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

# CLI flag -> EngineConfig field, for the engine options passed through to LLM(...).
ENGINE_OPTIONS = {
    "max_batch_size": "max_batch_size",
    "max_num_tokens": "max_num_tokens",
    "max_model_len": "max_model_len",
    "kv_blocks": "kv_cache_blocks",
    "kv_block_size": "kv_block_size",
    "kv_cache_memory_fraction": "kv_cache_memory_fraction",
    "scheduling_policy": "scheduling_policy",
    "dtype": "dtype",
    "device": "device",
    "seed": "seed",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", help="a Hugging Face model directory (see `berth make-tiny-model`)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one")
    parser.add_argument("--served-model-name", help="the model's name in the API (default: MODEL)")
    parser.add_argument("--api-key", help="require this bearer token on /v1 (default: $BERTH_API_KEY)")
    parser.add_argument(
        "--admin-token", help="require this bearer token on /admin (default: $BERTH_ADMIN_TOKEN)"
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=25.0,
        help="seconds in-flight requests may take to finish after SIGTERM before being aborted (default 25)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument(
        "--attach", metavar="tcp://HOST:PORT", help="serve an engine started elsewhere (not supported yet)"
    )
    engine = parser.add_argument_group("engine options")
    engine.add_argument(
        "--executor",
        choices=("proxy", "in-process"),
        help="where the engine runs: proxy (a worker process, the default) or in-process",
    )
    engine.add_argument("--max-batch-size", type=int)
    engine.add_argument("--max-num-tokens", type=int, help="token budget of one engine step")
    engine.add_argument("--max-model-len", type=int, help="default: the model's max_position_embeddings")
    engine.add_argument("--kv-blocks", type=int, help="KV cache size in blocks (default: from free memory)")
    engine.add_argument("--kv-block-size", type=int, help="tokens per KV block")
    engine.add_argument("--kv-cache-memory-fraction", type=float)
    engine.add_argument("--scheduling-policy", choices=("fcfs", "priority"))
    engine.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"))
    engine.add_argument("--device", type=_device, help="cpu, cuda or cuda:N (default: cuda when available)")
    engine.add_argument("--seed", type=int, help="the engine's sampling seed for unseeded requests")


def _device(value: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: cpu, cuda or cuda:N")
    return value


def _fail(message: str) -> int:
    print(f"berth serve: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.attach is not None:
        return _fail(
            f"--attach {args.attach}: attaching to an engine started elsewhere is not supported yet; "
            "run `berth serve MODEL_DIR` to serve an engine of its own"
        )
    if args.model is None:
        return _fail("MODEL is required: a model directory to serve")
    if not (Path(args.model) / "config.json").is_file():
        return _fail(f"{args.model} is not a model directory (no config.json)")
    if args.shutdown_timeout < 0:
        return _fail(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    options = {
        field: getattr(args, flag)
        for flag, field in ENGINE_OPTIONS.items()
        if getattr(args, flag) is not None
    }

    from berth.engine.config import EngineConfig
    from berth.engine.serve.server import bind, url_of

    try:
        EngineConfig(model=args.model, **options)  # refuse bad engine options before loading anything
    except ValueError as error:
        return _fail(str(error))
    try:
        sock = bind(args.host, args.port)
    except OSError as error:
        return _fail(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    with sock:
        return _serve(args, options, sock, url_of(sock))


def _serve(args: argparse.Namespace, options: dict, sock, url: str) -> int:
    import prometheus_client

    from berth.engine import LLM
    from berth.engine.serve import ServingContext, build_app
    from berth.engine.serve.server import serve

    # No `*_created` timestamp series next to every counter and histogram (as vLLM does): this
    # process serves one model, and the series only double the exposition.
    prometheus_client.disable_created_metrics()
    executor = {"executor": args.executor} if args.executor else {}
    try:
        llm = LLM(args.model, **executor, **options)
    except (ValueError, OSError) as error:
        return _fail(f"cannot start the engine: {error}")
    try:
        ctx = ServingContext.for_llm(
            llm,
            args.served_model_name,
            api_key=args.api_key or os.environ.get("BERTH_API_KEY") or None,
            admin_token=args.admin_token or os.environ.get("BERTH_ADMIN_TOKEN") or None,
        )
        print(
            f"berth serve: loaded {ctx.model_path} as {ctx.model_name!r} (executor "
            f"{args.executor or 'default'}, engine pid {llm.executor.engine_pid}, max_model_len "
            f"{ctx.max_model_len}, max_batch_size {llm.config.max_batch_size})",
            flush=True,
        )
        serve(
            build_app(ctx),
            sock,
            on_signal=lambda: setattr(ctx, "draining", True),
            on_started=lambda: print(f"berth serve: listening on {url}", flush=True),
            is_idle=lambda: ctx.idle,
            on_timeout=ctx.abort_all,
            shutdown_timeout=args.shutdown_timeout,
            log_level=args.log_level,
            access_log=args.access_log,
        )
    finally:
        llm.shutdown()  # aborts whatever the grace period left running
    print("berth serve: stopped", flush=True)
    return 0
