"""`berth serve`'s arguments (and `berth launch`'s, which adds its world's): what they are, and the
checks that need no engine. The owner's server (`owner.py`) and an attached frontend's
(`attached.py`) take them from here."""

from __future__ import annotations

import argparse
import re
import sys

from berth.engine.serve.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from berth.engine.serve.reasoning import REASONING_PARSERS
from berth.engine.serve.tool_parsers import PARSERS

# CLI flag -> EngineConfig field, for the engine options passed through to LLM(...).
ENGINE_OPTIONS = {
    "max_batch_size": "max_batch_size",
    "max_num_tokens": "max_num_tokens",
    "max_model_len": "max_model_len",
    "kv_blocks": "kv_cache_blocks",
    "kv_block_size": "kv_block_size",
    "kv_cache_memory": "kv_cache_memory",
    "kv_cache_memory_fraction": "kv_cache_memory_fraction",
    "kv_cache_dtype": "kv_cache_dtype",
    "scheduling_policy": "scheduling_policy",
    "dtype": "dtype",
    "device": "device",
    "seed": "seed",
    "prefix_caching": "enable_prefix_caching",
    "tensor_parallel_size": "tensor_parallel_size",
    "stall_timeout": "stall_timeout",
    "first_step_timeout": "first_step_timeout",
    "transition_timeout": "transition_timeout",
    "enforce_eager": "enforce_eager",
    "batch_wait_timeout_ms": "batch_wait_timeout_ms",
    "batch_wait_max_tokens_ratio": "batch_wait_max_tokens_ratio",
    "kv_events_endpoint": "kv_events_endpoint",
    "kv_events_snapshot_endpoint": "kv_events_snapshot_endpoint",
    "kv_events_engine_id": "kv_events_engine_id",
    "kv_transfer_endpoint": "kv_transfer_endpoint",
}
# Options of the process that owns the engine: an attached frontend has none of them.
OWNER_OPTIONS = (*ENGINE_OPTIONS, "executor", "num_postprocess_workers", "attach_port", "model_revision")
ATTACH_ADDRESS = re.compile(r"tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", help="a Hugging Face model directory (see `berth make-tiny-model`)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one")
    parser.add_argument(
        "--admin-port",
        type=int,
        help="serve /admin on this port of --host instead of --port, which then answers 404 there "
        "(a Service exposes --port only; the operator reaches this one on the pod's IP)",
    )
    parser.add_argument("--served-model-name", help="the model's name in the API (default: MODEL)")
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="split a reasoning model's thinking into reasoning_content (default: none, all is content)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        help="the format the model writes tool calls in (default: read from its chat template, else hermes)",
    )
    parser.add_argument(
        "--model-revision",
        metavar="LABEL",
        help="a name for the weights in MODEL (a date, a commit), reported as model_revision.label "
        "in /admin/state next to their digest; a wakeup that loads other weights replaces it",
    )
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
        "--max-request-body-bytes",
        type=int,
        default=None,
        help=f"refuse (413) request bodies larger than this (default {DEFAULT_MAX_REQUEST_BODY_BYTES})",
    )
    parser.add_argument(
        "--attach",
        metavar="tcp://HOST:PORT",
        help="serve the engine another process owns (`berth serve MODEL --attach-port PORT`, or "
        "`berth launch`) as an attached frontend; needs BERTH_ENGINE_KEY; give no MODEL",
    )
    add_attach_port_argument(parser)
    parser.add_argument(
        "--role",
        choices=("both", "context", "generation"),
        default="both",
        help="in disaggregated serving: run only the context part of requests (the prompt; needs "
        "--kv-transfer-endpoint), only the generation part, or both (default)",
    )
    parser.add_argument(
        "--route",
        action="append",
        metavar="ROLE=URL[,URL...]",
        help="be a router, not a server of a model: run each OpenAI request on a context server, then "
        "on a generation server (give context=... and generation=...; no MODEL)",
    )
    engine = parser.add_argument_group("engine options")
    engine.add_argument(
        "--executor",
        choices=("proxy", "in-process"),
        help="where the engine runs: proxy (a worker process, the default) or in-process",
    )
    engine.add_argument(
        "--num-postprocess-workers",
        type=int,
        help="detokenize, match stop strings and decode logprobs in N processes of their own "
        "(default 0: in the server's process; needs the proxy executor)",
    )
    engine.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help="shard the model over this many ranks (an MPI world started with mpich's mpiexec; default 1)",
    )
    # vLLM's names too, for the same knobs.
    engine.add_argument("--max-batch-size", "--max-num-seqs", dest="max_batch_size", type=int)
    engine.add_argument(
        "--max-num-tokens",
        "--max-num-batched-tokens",
        dest="max_num_tokens",
        type=int,
        help="token budget of one engine step",
    )
    engine.add_argument("--max-model-len", type=int, help="default: the model's max_position_embeddings")
    engine.add_argument(
        "--kv-blocks", type=int, help="KV cache size in blocks (default: from the memory limits)"
    )
    engine.add_argument(
        "--kv-cache-memory",
        type=byte_count,
        metavar="BYTES",
        help="KV cache size in bytes (e.g. 4Gi, 512Mi, 2G, 1000000; default: from the memory limits)",
    )
    engine.add_argument("--kv-block-size", type=int, help="tokens per KV block")
    engine.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        help="of the memory the limits leave, the KV cache's share (default: "
        "$BERTH_KV_CACHE_MEMORY_FRACTION, or 0.9)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="the KV cache's dtype (default auto: the model's); bfloat16 halves a float32 model's",
    )
    engine.add_argument(
        "--stall-timeout",
        type=float,
        metavar="SECONDS",
        help="while the engine has work, a step must complete within this (default 60); past "
        "it the engine is dead: /health answers 503 with reason stalled",
    )
    engine.add_argument(
        "--first-step-timeout",
        type=float,
        metavar="SECONDS",
        help="the same bound for the first step after load or wakeup (default: 5x --stall-timeout)",
    )
    engine.add_argument(
        "--transition-timeout",
        type=float,
        metavar="SECONDS",
        help="a sleep (after its drain) or a wakeup must complete within this (default 600); past "
        "it the engine is dead: /health answers 503 with reason stalled",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="on a GPU, run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    engine.add_argument("--scheduling-policy", choices=("fcfs", "priority"))
    engine.add_argument(
        "--batch-wait-timeout-ms",
        type=float,
        metavar="MS",
        help="the enqueue window: a new request may wait up to this long for others to start as one "
        "batch, never longer (default 0: off; at most 1000)",
    )
    engine.add_argument(
        "--batch-wait-max-tokens-ratio",
        type=float,
        metavar="RATIO",
        help="close the enqueue window early once the next step would carry this share of "
        "--max-num-tokens (0 to 1; default 0: only a full batch or the timeout closes it)",
    )
    engine.add_argument(
        "--kv-events-endpoint",
        metavar="tcp://HOST:PORT",
        help="publish KV-cache events (blocks stored / removed, cache cleared) on a ZeroMQ PUB socket "
        "bound here (default: none)",
    )
    engine.add_argument(
        "--kv-events-snapshot-endpoint",
        metavar="tcp://HOST:PORT",
        help="answer late subscribers' snapshot requests (the cache's contents) on a ZeroMQ ROUTER "
        "socket bound here",
    )
    engine.add_argument(
        "--kv-transfer-endpoint",
        metavar="tcp://HOST:PORT",
        help="serve the KV blocks of context-only requests to generation engines on this ZeroMQ "
        "endpoint (disaggregated serving; transfers are signed with BERTH_KV_TRANSFER_KEY, else "
        "BERTH_ENGINE_KEY)",
    )
    engine.add_argument(
        "--kv-events-engine-id",
        metavar="NAME",
        help="this engine's name in its KV events (default: host:pid)",
    )
    engine.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"))
    engine.add_argument(
        "--device", type=device_name, help="cpu, cuda or cuda:N (default: cuda when available)"
    )
    engine.add_argument("--seed", type=int, help="the engine's sampling seed for unseeded requests")
    engine.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        default=None,
        help="compute every prompt in full instead of reusing cached KV blocks of shared prefixes",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        dest="prefix_caching",
        action="store_true",
        help="reuse cached KV blocks of shared prefixes (the default; vLLM's flag)",
    )


def add_attach_port_argument(parser: argparse.ArgumentParser) -> None:
    """`--attach-port`, for every command whose process owns an engine (serve, launch)."""
    parser.add_argument(
        "--attach-port",
        type=int,
        metavar="PORT",
        help="let frontends (`berth serve --attach tcp://THIS_HOST:PORT`) share this engine: "
        "listen for them on --host:PORT (0 picks a free port); needs BERTH_ENGINE_KEY",
    )


def device_name(value: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: cpu, cuda or cuda:N")
    return value


_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 1 << 10, "mi": 1 << 20}
_BYTE_UNITS |= {"gi": 1 << 30, "ti": 1 << 40}


def byte_count(value: str) -> int:
    """A byte count: a plain integer, or with a unit (k, M, G, T; Ki, Mi, Gi, Ti; a trailing B)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", value)
    if match is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a byte count (e.g. 4Gi, 512Mi, 2G, 1000000)")
    return int(float(match[1]) * _BYTE_UNITS[(match[2] or "").lower()])


def fail(message: str, command: str = "berth serve") -> int:
    print(f"{command}: error: {message}", file=sys.stderr)
    return 2


def check_server_options(args: argparse.Namespace) -> str | None:
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}"
    if args.max_request_body_bytes is not None and args.max_request_body_bytes < 1:
        return f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}"
    if args.admin_port is not None and args.admin_port == args.port != 0:
        return f"--admin-port must differ from --port ({args.port}): /admin gets a listener of its own"
    return None
