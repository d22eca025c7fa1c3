"""`berth serve MODEL_DIR`: the OpenAI-compatible server for one model.

Loads the engine, listens, prints where, and on SIGTERM stops admitting (new requests get
503 + Retry-After, /ready 503), lets in-flight requests finish for up to --shutdown-timeout
seconds (then aborts them: they end with finish_reason "abort"), and exits 0.

`--attach-port PORT` lets attached frontends share the engine; `berth serve --attach
tcp://HOST:PORT` is such a frontend: the same server, for an engine another process owns.
Both need the deployment's engine key in BERTH_ENGINE_KEY. `--role` and `berth serve --route`
split requests over context and generation servers (disaggregated prefill and decode).

The arguments are `arguments.py`'s, the owner's server `owner.py`, a frontend's `attached.py`.
"""

from __future__ import annotations

import argparse

from berth.engine.serve.arguments import add_arguments

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    if args.route:
        from berth.engine.serve.router import run_router

        return run_router(args)
    if args.attach is not None:
        from berth.engine.serve.attached import run_frontend

        return run_frontend(args)
    from berth.engine.serve.owner import serve_model

    return serve_model(args)
