"""STAND-IN for `berth serve` (not the real server): the HTTP contract the operator polls.

`berth serve` is being built in parallel; until it exists, the operator's health and restart
tests poll this script instead. It follows DESIGN.md's contract ("The HTTP face") for the
endpoints the operator reads, and its engine is a real separate process, so a test's
`kill -9` is a real kill of a real process:

  GET /health       200 {"status": "ok"} while the engine process lives;
                    503 {"engine_dead": true, "error": "..."} once it died (sticky: it never
                    answers 200 again, however long this server lives)
  GET /ready        200 {"admission": "running"} when alive, else 503 {"admission": "failed"}
  GET /live         200 (the HTTP process answers)
  GET /admin/state  (Authorization: Bearer $BERTH_ADMIN_TOKEN when set) admission, counts,
                    model, model_revision, and engine_pid (the process a test may kill)

Usage: python standin_engine_server.py --host 127.0.0.1 --port PORT [--model NAME]
Only the standard library: it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The "engine worker": a separate process that lives until killed, and leaves when its
# parent (this server) is gone, so a server killed with SIGKILL leaves no orphan behind.
ENGINE_CODE = """
import os, time
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.2)
"""


class Engine:
    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", ENGINE_CODE])
        self.error: str | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        code = self.process.wait()
        if code < 0:
            how = f"killed by signal {-code} ({signal.Signals(-code).name})"
        else:
            how = f"exited with code {code}"
        with self._lock:
            # The first fatal error wins and stays: /health must not lie later.
            self.error = self.error or f"engine worker process {self.process.pid} {how}"

    @property
    def dead_error(self) -> str | None:
        with self._lock:
            return self.error

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)


def make_handler(engine: Engine, model: str, admin_token: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            error = engine.dead_error
            if self.path == "/health":
                if error:
                    self._send(503, {"engine_dead": True, "error": error})
                else:
                    self._send(200, {"status": "ok"})
            elif self.path == "/ready":
                self._send(503 if error else 200, {"admission": "failed" if error else "running"})
            elif self.path == "/live":
                self._send(200, {"status": "ok"})
            elif self.path == "/admin/state":
                if admin_token and self.headers.get("Authorization") != f"Bearer {admin_token}":
                    self._send(401, {"error": {"message": "missing or wrong bearer token", "code": 401}})
                    return
                self._send(
                    200,
                    {
                        "admission": "failed" if error else "running",
                        "running": 0,
                        "waiting": 0,
                        "model": model,
                        "model_revision": "standin",
                        "engine_pid": engine.process.pid,
                    },
                )
            else:
                self._send(404, {"error": {"message": f"no route {self.path}", "code": 404}})

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: tests read the state, not the access log

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="standin-model")
    args = parser.parse_args()

    engine = Engine()
    server = ThreadingHTTPServer(
        (args.host, args.port), make_handler(engine, args.model, os.environ.get("BERTH_ADMIN_TOKEN"))
    )

    def shutdown(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        engine.stop()
        server.server_close()


if __name__ == "__main__":
    main()
