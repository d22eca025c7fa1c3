"""The engine owner's server: `berth serve MODEL` (and `berth launch`, whose world spans hosts).

It answers probes from the start while the engine loads on a thread, serves once it has loaded
(frontends may attach from then on, with --attach-port), and on SIGTERM drains: admission stops
here and for every attached frontend at once, requests in flight everywhere finish within
--shutdown-timeout (then are aborted), and only then is the engine shut down.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

from berth.engine.serve.admin_listener import bind_admin
from berth.engine.serve.arguments import ENGINE_OPTIONS, check_server_options, fail
from berth.engine.serve.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from berth.engine.serve.server import quiet_metrics, serve_app


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
        return fail("MODEL is required: a model directory to serve", command)
    if not (Path(args.model) / "config.json").is_file():
        return fail(f"{args.model} is not a model directory (no config.json)", command)
    problem = check_server_options(args)
    if problem:
        return fail(problem, command)
    workers = args.num_postprocess_workers
    if workers is not None and workers < 0:
        return fail(f"--num-postprocess-workers must be >= 0, got {workers}", command)
    if workers and args.executor == "in-process":
        return fail("--num-postprocess-workers needs the proxy executor, not --executor in-process", command)
    options = {
        field: getattr(args, flag)
        for flag, field in ENGINE_OPTIONS.items()
        if getattr(args, flag) is not None
    }

    from berth.engine.config import EngineConfig
    from berth.engine.serve.server import bind, url_of

    if args.role == "context" and args.kv_transfer_endpoint is None:
        return fail(
            "--role context needs --kv-transfer-endpoint (where generation servers pull the KV)", command
        )
    try:
        EngineConfig(model=args.model, **options)  # refuse bad engine options before loading anything
    except ValueError as error:
        return fail(str(error), command)
    try:
        sock = bind(args.host, args.port)
    except OSError as error:
        return fail(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}", command)
    try:
        admin_sock = bind_admin(args)
    except OSError as error:
        sock.close()
        return fail(f"cannot listen on {args.host}:{args.admin_port}: {error.strerror or error}", command)
    endpoint = None
    if args.attach_port is not None:
        try:
            endpoint = open_attach_endpoint(args.host, args.attach_port)
        except ValueError as error:
            sock.close()
            if admin_sock is not None:
                admin_sock.close()
            return fail(str(error), command)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    with sock, admin_sock or contextlib.nullcontext():
        if before_start is not None and (code := before_start()) is not None:
            if endpoint is not None:
                endpoint.close()
            return code
        return _serve(
            args, options, (sock, admin_sock), url_of(sock), endpoint, world, command, exit_when_dead_after
        )


def _serve(
    args: argparse.Namespace,
    options: dict,
    listeners: tuple,  # (the public socket, the admin socket or None)
    url: str,
    endpoint,
    world,
    command: str,
    exit_when_dead_after: float | None,
) -> int:
    from berth.engine.serve.health import fatal_error_of

    quiet_metrics()
    # The server answers from now on (probes, /admin/state with the load's progress); the
    # engine loads on a thread meanwhile, and "listening on" is said once it serves.
    ctx = loading_context(args)
    loader = EngineLoader(args, options, world, ctx, endpoint, url, command)
    loader.start()
    dead = DeathWatch(loader, exit_when_dead_after)
    answering = f"{command}: answering probes on {url} while the engine loads"
    try:
        serve_app(
            args,
            ctx,
            listeners[0],
            url,
            command,
            stop_when=lambda: loader.failed or dead.long_enough(),
            on_started=lambda: print(answering, flush=True),
            admin_sock=listeners[1],
        )
    finally:
        llm = loader.finish()  # waits for a load still under way: it cannot be interrupted
        if llm is not None:
            llm.shutdown()  # aborts whatever the grace period left running (the frontends' too)
        if endpoint is not None:
            endpoint.close()  # after: the frontends' aborted requests are answered first
    if loader.error is not None:
        return fail(f"cannot start the engine: {loader.error}", command)
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


def loading_context(args: argparse.Namespace):
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
        role=args.role,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
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
