"""An attached frontend's server: `berth serve --attach tcp://OWNER:PORT`, the same OpenAI server
for an engine another process owns (it attaches, and attaches again to the next owner)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
import time

from berth.engine.serve.admin_listener import bind_admin
from berth.engine.serve.arguments import ATTACH_ADDRESS, OWNER_OPTIONS, check_server_options, fail
from berth.engine.serve.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from berth.engine.serve.server import quiet_metrics, serve_app

WAITING_REPORT_SECONDS = 10.0  # how often a frontend that cannot attach says so


def run_frontend(args: argparse.Namespace) -> int:
    from berth.engine.executor import ipc

    if args.model is not None:
        return fail(f"--attach serves the engine at {args.attach}, which has the model: give no MODEL")
    given = [name for name in OWNER_OPTIONS if getattr(args, name, None) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        if given[0] == "prefix_caching":
            flag = "--no-prefix-caching"
        return fail(f"{flag} is an option of the engine's owner: an attached frontend (--attach) has none")
    if not ATTACH_ADDRESS.fullmatch(args.attach) or not 0 < int(args.attach.rsplit(":", 1)[1]) <= 65535:
        return fail(f"--attach must be tcp://HOST:PORT (the owner's --attach-port), got {args.attach!r}")
    problem = check_server_options(args)
    if problem:
        return fail(problem)
    try:
        key = ipc.key_from_env()
    except RuntimeError as error:
        return fail(f"--attach: {error} (the owner's: the frontend proves it holds it)")
    from berth.engine.serve.server import bind, url_of

    try:
        sock = bind(args.host, args.port)
    except OSError as error:
        return fail(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}")
    try:
        admin_sock = bind_admin(args)
    except OSError as error:
        sock.close()
        return fail(f"cannot listen on {args.host}:{args.admin_port}: {error.strerror or error}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    with sock, admin_sock or contextlib.nullcontext():
        return _serve_frontend(args, key, sock, url_of(sock), admin_sock)


def _serve_frontend(args: argparse.Namespace, key: bytes, sock, url: str, admin_sock=None) -> int:
    from berth.engine.llm import AttachedLLM

    quiet_metrics()
    llm = AttachedLLM(args.attach, key=key)
    try:
        if not _wait_attached(llm, args.attach):
            print("berth serve: stopped before attaching", flush=True)
            return 0
        ctx = frontend_context(args, llm, args.served_model_name or llm.served_model_name)
        print(
            f"berth serve: attached to {args.attach} as frontend {llm.executor.frontend_id} (engine pid "
            f"{llm.executor.engine_pid}, {ctx.model_path} as {ctx.model_name!r}, max_model_len "
            f"{ctx.max_model_len})",
            flush=True,
        )
        serve_app(args, ctx, sock, url, admin_sock=admin_sock)
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


def frontend_context(args: argparse.Namespace, llm, model_name: str | None):
    from berth.engine.serve import ServingContext

    return ServingContext.for_llm(
        llm,
        model_name,
        api_key=args.api_key or os.environ.get("BERTH_API_KEY") or None,
        admin_token=args.admin_token or os.environ.get("BERTH_ADMIN_TOKEN") or None,
        max_request_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
        model_label=args.model_revision,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
