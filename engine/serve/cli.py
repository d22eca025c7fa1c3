"""`berth serve MODEL_DIR`: the OpenAI-compatible server for one model.

Loads the engine, listens, prints where, and on SIGTERM stops admitting (new requests get
503 + Retry-After, /ready 503), lets in-flight requests finish for up to --shutdown-timeout
seconds (then aborts them: they end with finish_reason "abort"), and exits 0.

`--attach-port PORT` lets attached frontends share the engine; `berth serve --attach
tcp://HOST:PORT` is such a frontend: the same server, for an engine another process owns.
Both need the deployment's engine key in BERTH_ENGINE_KEY.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from berth.engine.serve.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES

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
    parser.add_argument("--served-model-name", help="the model's name in the API (default: MODEL)")
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
        type=_bytes,
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
    engine.add_argument("--scheduling-policy", choices=("fcfs", "priority"))
    engine.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"))
    engine.add_argument("--device", type=_device, help="cpu, cuda or cuda:N (default: cuda when available)")
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


def open_attach_endpoint(host: str, port: int):
    """The attach endpoint on host:port, signed with BERTH_ENGINE_KEY; bind it before the model
    loads (a port in use fails at once). Raises ValueError with a message for the user."""
    from berth.engine.executor import ipc
    from berth.engine.executor.attach import AttachEndpoint

    if not 0 <= port <= 65535:
        raise ValueError(f"--attach-port must be a port number (0 picks a free one), got {port}")
    try:
        key = ipc.key_from_env()
    except RuntimeError as error:
        raise ValueError(f"--attach-port: {error} (frontends prove they hold it)") from None
    import zmq

    address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    try:
        return AttachEndpoint(address, key)
    except zmq.ZMQError as error:
        raise ValueError(f"cannot listen for frontends on {host}:{port}: {error}") from None


def _device(value: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: cpu, cuda or cuda:N")
    return value


_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 1 << 10, "mi": 1 << 20}
_BYTE_UNITS |= {"gi": 1 << 30, "ti": 1 << 40}


def _bytes(value: str) -> int:
    """A byte count: a plain integer, or with a unit (k, M, G, T; Ki, Mi, Gi, Ti; a trailing B)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", value)
    if match is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a byte count (e.g. 4Gi, 512Mi, 2G, 1000000)")
    return int(float(match[1]) * _BYTE_UNITS[(match[2] or "").lower()])


def _fail(message: str, command: str = "berth serve") -> int:
    print(f"{command}: error: {message}", file=sys.stderr)
    return 2


def _check_server_options(args: argparse.Namespace) -> str | None:
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}"
    if args.max_request_body_bytes is not None and args.max_request_body_bytes < 1:
        return f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}"
    return None


def run(args: argparse.Namespace) -> int:
    if args.attach is not None:
        return _run_frontend(args)
    return serve_model(args)


def serve_model(
    args: argparse.Namespace,
    *,
    world=None,
    command: str = "berth serve",
    exit_when_dead_after: float | None = None,
    before_start=None,
) -> int:
    """Serves `args.model` until SIGTERM / SIGINT (exit 0), or, with `exit_when_dead_after`,
    until the engine has been dead that many seconds (exit 1: `berth launch`, whose world
    ended). `world`: where a tensor-parallel engine's ranks run (`LLM(world=...)`).
    `before_start`: called after the options are checked, before the engine starts (None: go
    on; an int: exit with it). With --attach-port, frontends attach to the engine."""
    if args.model is None:
        return _fail("MODEL is required: a model directory to serve", command)
    if not (Path(args.model) / "config.json").is_file():
        return _fail(f"{args.model} is not a model directory (no config.json)", command)
    problem = _check_server_options(args)
    if problem:
        return _fail(problem, command)
    workers = args.num_postprocess_workers
    if workers is not None and workers < 0:
        return _fail(f"--num-postprocess-workers must be >= 0, got {workers}", command)
    if workers and args.executor == "in-process":
        return _fail("--num-postprocess-workers needs the proxy executor, not --executor in-process", command)
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
        return _fail(str(error), command)
    try:
        sock = bind(args.host, args.port)
    except OSError as error:
        return _fail(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}", command)
    endpoint = None
    if args.attach_port is not None:
        try:
            endpoint = open_attach_endpoint(args.host, args.attach_port)
        except ValueError as error:
            sock.close()
            return _fail(str(error), command)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    with sock:
        if before_start is not None and (code := before_start()) is not None:
            if endpoint is not None:
                endpoint.close()
            return code
        return _serve(args, options, sock, url_of(sock), endpoint, world, command, exit_when_dead_after)


def _serve(
    args: argparse.Namespace,
    options: dict,
    sock,
    url: str,
    endpoint,
    world,
    command: str,
    exit_when_dead_after: float | None,
) -> int:
    from berth.engine.serve.health import fatal_error_of

    _quiet_metrics()
    # The server answers from now on (probes, /admin/state with the load's progress); the
    # engine loads on a thread meanwhile, and "listening on" is said once it serves.
    ctx = _loading_context(args)
    loader = EngineLoader(args, options, world, ctx, endpoint, url, command)
    loader.start()
    dead = DeathWatch(loader, exit_when_dead_after)
    answering = f"{command}: answering probes on {url} while the engine loads"
    try:
        _serve_app(
            args,
            ctx,
            sock,
            url,
            command,
            stop_when=lambda: loader.failed or dead.long_enough(),
            on_started=lambda: print(answering, flush=True),
        )
    finally:
        llm = loader.finish()  # waits for a load still under way: it cannot be interrupted
        if llm is not None:
            llm.shutdown()  # aborts whatever the grace period left running (the frontends' too)
        if endpoint is not None:
            endpoint.close()  # after: the frontends' aborted requests are answered first
    if loader.error is not None:
        return _fail(f"cannot start the engine: {loader.error}", command)
    if dead.long_enough():
        print(f"{command}: the engine died: {fatal_error_of(llm.executor)}", file=sys.stderr, flush=True)
        return 1
    print(f"{command}: stopped", flush=True)
    return 0


class EngineLoader:
    """Starts the engine on a thread of its own while the server already answers; once it is
    up, the server's context serves it (and frontends may attach)."""

    def __init__(self, args, options: dict, world, ctx, endpoint, url: str, command: str) -> None:
        self._args, self._options, self._world = args, options, world
        self._ctx, self._endpoint, self._url, self._command = ctx, endpoint, url, command
        self.llm = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._load, name="berth-engine-load", daemon=True)

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def executor(self):
        return self.llm.executor if self.llm is not None else None

    def start(self) -> None:
        self._thread.start()

    def finish(self):
        """The engine (None if it never started), once the load is over."""
        self._thread.join()
        return self.llm

    def _load(self) -> None:
        from berth.engine import LLM

        args, command = self._args, self._command
        executor = {"executor": args.executor} if args.executor else {}
        try:
            llm = LLM(
                args.model,
                **executor,
                world=self._world,
                num_postprocess_workers=args.num_postprocess_workers or 0,
                on_progress=self._ctx.loading.update,
                **self._options,
            )
        except (ValueError, OSError, RuntimeError) as error:
            self.error = error
            return
        except BaseException as error:  # a bug: still said, and the server stops
            logging.getLogger(__name__).exception("the engine failed to start")
            self.error = error
            return
        self.llm = llm
        ctx = self._ctx
        limits = llm.limits
        if limits.kv_cache is not None:
            _say(f"{command}: {limits.kv_cache.describe()}")
        caching = "on" if llm.config.enable_prefix_caching else "off"
        ranks = llm.config.tensor_parallel_size
        world_size = f", {ranks} tensor-parallel ranks" if ranks > 1 else ""
        _say(
            f"{command}: loaded {ctx.model_path} as {ctx.model_name!r} (executor "
            f"{args.executor or 'default'}{world_size}, engine pid {llm.executor.engine_pid}, max_model_len "
            f"{limits.max_model_len}, max_batch_size {limits.max_batch_size}, KV blocks "
            f"{limits.num_kv_blocks}, prefix caching {caching}, postprocess workers "
            f"{args.num_postprocess_workers or 0}, loaded in {ctx.loading.describe()['seconds']:g} s)"
        )
        ctx.llm = llm  # from here on the loading gate lets everything through
        if self._endpoint is not None:
            self._endpoint.start(llm.executor, ctx.model_name)
            ctx.frontends = self._endpoint
            if ctx.draining:  # SIGTERM came while the engine loaded: no frontend is admitted
                ctx.start_draining()
            _say(f"{command}: frontends attach at {self._endpoint.address}")
        _say(f"{command}: listening on {self._url}")


def _say(line: str) -> None:
    """One line on stdout in one write: this runs beside threads that log (a print writes its
    text and its newline apart, and a log line could land between them)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class DeathWatch:
    """Whether the engine has been dead for `seconds` (so that /health answered 503 with the
    error meanwhile, for whoever polls it), checked from the server's loop."""

    def __init__(self, source, seconds: float | None) -> None:
        self._source = source  # has `.executor`: None until the engine is up
        self._seconds = seconds
        self._dead_since: float | None = None

    def long_enough(self) -> bool:
        if self._seconds is None:
            return False
        if self._dead_since is None:
            executor = self._source.executor
            if executor is None or not executor.is_dead:
                return False
            self._dead_since = time.monotonic()
        return time.monotonic() - self._dead_since >= self._seconds


def _quiet_metrics() -> None:
    import prometheus_client

    # No `*_created` timestamp series next to every counter and histogram (as vLLM does): this
    # process serves one model, and the series only double the exposition.
    prometheus_client.disable_created_metrics()


def _loading_context(args: argparse.Namespace):
    """The server's context before the engine exists: the loading gate answers for it."""
    from berth.engine.serve import ServingContext
    from berth.engine.serve.loading import Loading
    from berth.engine.serve.metrics import ServerMetrics

    name = args.served_model_name or str(args.model)
    return ServingContext(
        llm=None,
        model_name=name,
        model_path=str(args.model),
        metrics=ServerMetrics(name),
        api_key=args.api_key or os.environ.get("BERTH_API_KEY") or None,
        admin_token=args.admin_token or os.environ.get("BERTH_ADMIN_TOKEN") or None,
        max_request_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
        loading=Loading(),
        model_label=args.model_revision,
    )


def _context(args: argparse.Namespace, llm, model_name: str | None):
    from berth.engine.serve import ServingContext

    return ServingContext.for_llm(
        llm,
        model_name,
        api_key=args.api_key or os.environ.get("BERTH_API_KEY") or None,
        admin_token=args.admin_token or os.environ.get("BERTH_ADMIN_TOKEN") or None,
        max_request_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
        model_label=args.model_revision,
    )


def _serve_app(
    args: argparse.Namespace,
    ctx,
    sock,
    url: str,
    command: str = "berth serve",
    stop_when=None,
    on_started=None,
) -> None:
    from berth.engine.serve import build_app
    from berth.engine.serve.server import serve

    serve(
        build_app(ctx),
        sock,
        on_signal=ctx.start_draining,
        on_started=on_started or (lambda: print(f"{command}: listening on {url}", flush=True)),
        is_idle=lambda: ctx.idle,
        on_timeout=ctx.abort_all,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
        access_log=args.access_log,
        stop_when=stop_when,
    )


# ---- an attached frontend ---------------------------------------------------------------------

WAITING_REPORT_SECONDS = 10.0  # how often a frontend that cannot attach says so


def _run_frontend(args: argparse.Namespace) -> int:
    from berth.engine.executor import ipc

    if args.model is not None:
        return _fail(f"--attach serves the engine at {args.attach}, which has the model: give no MODEL")
    given = [name for name in OWNER_OPTIONS if getattr(args, name, None) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        if given[0] == "prefix_caching":
            flag = "--no-prefix-caching"
        return _fail(f"{flag} is an option of the engine's owner: an attached frontend (--attach) has none")
    if not ATTACH_ADDRESS.fullmatch(args.attach) or not 0 < int(args.attach.rsplit(":", 1)[1]) <= 65535:
        return _fail(f"--attach must be tcp://HOST:PORT (the owner's --attach-port), got {args.attach!r}")
    problem = _check_server_options(args)
    if problem:
        return _fail(problem)
    try:
        key = ipc.key_from_env()
    except RuntimeError as error:
        return _fail(f"--attach: {error} (the owner's: the frontend proves it holds it)")
    from berth.engine.serve.server import bind, url_of

    try:
        sock = bind(args.host, args.port)
    except OSError as error:
        return _fail(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    with sock:
        return _serve_frontend(args, key, sock, url_of(sock))


def _serve_frontend(args: argparse.Namespace, key: bytes, sock, url: str) -> int:
    from berth.engine.llm import AttachedLLM

    _quiet_metrics()
    llm = AttachedLLM(args.attach, key=key)
    try:
        if not _wait_attached(llm, args.attach):
            print("berth serve: stopped before attaching", flush=True)
            return 0
        ctx = _context(args, llm, args.served_model_name or llm.served_model_name)
        print(
            f"berth serve: attached to {args.attach} as frontend {llm.executor.frontend_id} (engine pid "
            f"{llm.executor.engine_pid}, {ctx.model_path} as {ctx.model_name!r}, max_model_len "
            f"{ctx.max_model_len})",
            flush=True,
        )
        _serve_app(args, ctx, sock, url)
    finally:
        llm.shutdown()  # detaches: the owner aborts what this frontend left running
    print("berth serve: stopped", flush=True)
    return 0


def _wait_attached(llm, address: str) -> bool:
    """Waits for the first attachment (the owner may still be loading its model), saying why
    every so often; False if SIGTERM or SIGINT came first."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        report_at = time.monotonic() + WAITING_REPORT_SECONDS / 5
        while not llm.wait_attached(0.2):
            if stop.is_set():
                return False
            if time.monotonic() >= report_at:
                print(
                    f"berth serve: waiting for the engine at {address}: {llm.executor.fatal_error}",
                    flush=True,
                )
                report_at = time.monotonic() + WAITING_REPORT_SECONDS
        return True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
