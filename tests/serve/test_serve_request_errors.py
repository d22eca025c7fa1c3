"""One request's postprocessing error fails that request alone, in every process shape (and a
structured output is valid in each).

The fault is real: a tokenizer whose decoder raises on one token id (a test double of Hugging
Face `tokenizers`' `DecodeStream`, `tests/support/poisoned_tokenizers`), in whichever process
detokenizes: the server's (in-process engine, proxy), a postprocess worker's, or an attached
frontend's. While 16 other requests stream, the request that meets it gets a 500
`internal_error`; the 16 finish, the engine aborts the failed one and goes on (`/health` 200).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from pathlib import Path

import httpx
import jsonschema
import pytest

from berth.engine import LLM, SamplingParams
from berth.engine.models.tiny_model import make_tiny_model
from tests.serve.server_process import ADMIN_TOKEN, ENGINE_ARGS, ENGINE_OPTIONS, MODEL_NAME, ServerProcess

POISON_FOLDER = Path(__file__).resolve().parent.parent / "support" / "poisoned_tokenizers"
KEY = secrets.token_hex(32)
MAX_MODEL_LEN = 8192
# The failed request would run this long if the engine were not told: far more than the few
# hundred steps an abort can take to come back through three processes on a loaded machine.
TARGET_MAX_TOKENS = 8000
KV_BLOCKS = 1024  # the target and the 16 others at once, no preemption
OTHERS = 16
OTHER_MAX_TOKENS = 24
SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 50},
    "minItems": 2,
    "maxItems": 4,
}
CANDIDATE_PROMPTS = ("The river bends", "Owls at night", "Bread and glass", "Maps of the stars")
SHAPES = {
    "in-process": ("--executor", "in-process"),
    "proxy": (),
    "postprocess-workers": ("--num-postprocess-workers", "2"),
    "attached-frontend": None,  # an owner (proxy) and a frontend that detokenizes for itself
}


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("long-tiny"), max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def poisoned(long_model: Path) -> tuple[str, int, LLM]:
    """A prompt and its first greedy token, chosen with a clear lead over the runner-up (batched
    with 16 others, the server's engine picks the same first token), and the engine that said so."""
    with LLM(long_model, executor="in-process", **ENGINE_OPTIONS) as reference:
        best = None
        for prompt in CANDIDATE_PROMPTS:
            output = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=2))
            sequence = output[0].outputs[0]
            ranked = sorted(sequence.logprobs[0].values(), key=lambda entry: -entry.logprob)
            lead = ranked[0].logprob - ranked[1].logprob
            if best is None or lead > best[2]:
                best = (prompt, sequence.token_ids[0], lead)
        assert best[2] > 0.01, f"no candidate prompt has a clear first token: {best}"
        yield best[0], best[1], reference


def start_shape(model: Path, shape: str, poison: int) -> list[ServerProcess]:
    """The servers of `shape`; the last one is the one clients talk to."""
    poison_env = {"PYTHONPATH": str(POISON_FOLDER), "BERTH_TEST_POISON_TOKEN": str(poison)}
    env = {"BERTH_ENGINE_KEY": KEY, "BERTH_ADMIN_TOKEN": ADMIN_TOKEN}
    common = (*ENGINE_ARGS, "--kv-blocks", str(KV_BLOCKS), "--served-model-name", MODEL_NAME)
    if SHAPES[shape] is not None:
        return [
            ServerProcess(model, *common, *SHAPES[shape], env={**env, **poison_env}, admin_token=ADMIN_TOKEN)
        ]
    owner = ServerProcess(model, *common, "--attach-port", "0", env=env, admin_token=ADMIN_TOKEN)
    try:
        frontend = ServerProcess(
            None,
            "--attach",
            owner.attach_address,
            env={**env, **poison_env},
            admin_token=ADMIN_TOKEN,
        )
    except BaseException:
        owner.stop()
        raise
    return [owner, frontend]


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    finish = None
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "body": json.loads(await response.aread())}
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return {"status": 200, "error": chunk["error"]}
                finish = chunk["choices"][0]["finish_reason"] or finish
    return {"status": 200, "finish_reason": finish}


def run_requests(url: str, target: dict, others: list[dict]) -> tuple[httpx.Response, list[dict]]:
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            streamed = [stream(client, url, body) for body in others]
            failed = client.post(f"{url}/v1/completions", json=target)  # not streamed: one status
            results = await asyncio.gather(failed, *streamed)
            return results[0], list(results[1:])

    return asyncio.run(main())


def request_errors(server: ServerProcess, stage: str) -> float:
    metrics = server.get("/metrics").text
    found = re.search(rf'^berth_request_errors_total\{{[^}}]*stage="{stage}"[^}}]*\}} (\S+)$', metrics, re.M)
    assert found, metrics
    return float(found[1])


@pytest.mark.slow  # `berth serve` processes started, driven and stopped
@pytest.mark.parametrize("shape", SHAPES)
def test_a_postprocessing_error_fails_its_request_alone(long_model: Path, poisoned, shape: str):
    prompt, poison, reference = poisoned
    servers = start_shape(long_model, shape, poison)
    serving = servers[-1]
    try:
        engine = servers[0]  # the process that owns the engine
        before = engine.admin_state()["num_computed_tokens"]
        target = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "temperature": 0,
            "max_tokens": TARGET_MAX_TOKENS,
            "ignore_eos": True,
            "skip_special_tokens": False,  # the poisoned stream: this request alone meets the fault
        }
        others = [
            {
                "model": MODEL_NAME,
                "prompt": f"Stream {i} tells of {prompt.lower()}",
                "temperature": 0,
                "max_tokens": OTHER_MAX_TOKENS,
                "ignore_eos": True,
            }
            for i in range(OTHERS)
        ]
        failed, streamed = run_requests(serving.url, target, others)

        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["code"] == "internal_error" and error["type"] == "server_error", error
        assert "postprocess" in error["message"]
        assert streamed == [{"status": 200, "finish_reason": "length"}] * OTHERS
        for server in servers:
            assert server.get("/health").json() == {"status": "ok"}
        assert request_errors(serving, "postprocess") == 1
        assert "Invalid prefix encountered" in serving.output and "Traceback" in serving.output
        # The engine was told: it is idle, and stopped the failed request before its 8000 tokens
        # (how many it ran first is how long the abort took to reach it: a quarter of them on a
        # quiet machine, more with three test processes on two loaded cores).
        assert engine.wait_idle(timeout=30), engine.admin_state()
        prompts = sum(len(reference.tokenizer(body["prompt"])["input_ids"]) for body in [target, *others])
        work = prompts + OTHERS * OTHER_MAX_TOKENS
        computed = engine.admin_state()["num_computed_tokens"] - before
        assert computed < work + TARGET_MAX_TOKENS * 3 // 4, computed
        again = serving.post("/v1/completions", {**others[0], "max_tokens": 4})
        assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
        # A structured output in this shape too: its grammar is the owner's engine's, whoever detokenizes.
        shaped = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "n": 2,
            "max_tokens": 60,
            "seed": 1,
            "guided_json": SCHEMA,
        }
        answer = serving.post("/v1/completions", shaped)
        assert answer.status_code == 200, answer.text
        for choice in answer.json()["choices"]:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["text"]), SCHEMA)
    finally:
        for server in reversed(servers):
            server.stop()
