"""One chat completion from `berth serve`, with the official `openai` client.

    berth fetch-model smollm2 .cache/smollm2   # once
    berth serve .cache/smollm2 --port 8000 &
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1

The model is whatever the server serves (the first of `GET /v1/models`). A server started with
an API key needs it here too: `BERTH_API_KEY=... python examples/openai_client.py`.
"""

from __future__ import annotations

import argparse
import os
import time
import urllib.request

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--wait-ready", type=float, default=0, metavar="SECONDS", help="first wait for the server's /ready"
    )
    args = parser.parse_args()
    if args.wait_ready > 0:
        wait_ready(args.base_url.removesuffix("/").removesuffix("/v1"), args.wait_ready)

    client = OpenAI(
        base_url=args.base_url,
        api_key=os.environ.get("BERTH_API_KEY", "none"),  # the client insists on one
        timeout=60,
        max_retries=0,
    )
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": args.prompt}],
        max_completion_tokens=args.max_tokens,
        temperature=0,
    )
    choice = reply.choices[0]
    print(f"model:  {model}")
    print(f"prompt: {args.prompt}")
    print(f"answer: {choice.message.content!r} (finish_reason {choice.finish_reason})")
    print(f"usage:  {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens")


def wait_ready(server: str, timeout: float) -> None:
    """Until `GET /ready` answers 200 (the engine is loaded and admits requests)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{server}/ready", timeout=5):
                return
        except OSError as error:  # not listening yet, or 503 (HTTPError is an OSError)
            if time.monotonic() > deadline:
                raise SystemExit(f"{server}/ready: not ready after {timeout:.0f} s ({error})") from error
        time.sleep(0.2)


if __name__ == "__main__":
    main()
