"""`berth serve` refuses bad arguments with a message and exit code 2, never a traceback, and
before loading anything; `berth --help` lists every command."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from berth.cli import COMMANDS


def berth(*args: str, timeout: float = 60, key: str | None = None) -> subprocess.CompletedProcess:
    """`berth ARGS`, with BERTH_ENGINE_KEY set to `key` (unset when None)."""
    env = {k: v for k, v in os.environ.items() if k != "BERTH_ENGINE_KEY"}
    if key is not None:
        env["BERTH_ENGINE_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "berth", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def assert_refused(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert "listening on" not in result.stdout
    for word in words:
        assert word in result.stderr, result.stderr


def test_berth_help_lists_every_command_and_serve_has_its_own():
    result = berth("--help")
    assert result.returncode == 0
    for name in COMMANDS:
        assert name in result.stdout
    serve_help = berth("serve", "--help")
    assert serve_help.returncode == 0
    for option in ("--host", "--port", "--served-model-name", "--api-key", "--max-batch-size", "--dtype"):
        assert option in serve_help.stdout


def test_a_missing_model_directory_is_refused(tmp_path):
    assert_refused(berth("serve", str(tmp_path / "nowhere")), "not a model directory")


def test_no_model_is_refused():
    assert_refused(berth("serve"), "MODEL is required")


KEY = "ab" * 32


@pytest.mark.parametrize(
    ("args", "key", "words"),
    [
        (("MODEL", "--attach", "tcp://127.0.0.1:5555"), KEY, ("--attach", "give no MODEL")),
        (("--attach", "tcp://127.0.0.1:5555", "--max-batch-size", "4"), KEY, ("--max-batch-size", "owner")),
        (("--attach", "tcp://127.0.0.1:5555", "--no-prefix-caching"), KEY, ("--no-prefix-caching", "owner")),
        (("--attach", "tcp://127.0.0.1:5555", "--num-postprocess-workers", "2"), KEY, ("--num-postprocess",)),
        (("--attach", "tcp://127.0.0.1:5555", "--attach-port", "8001"), KEY, ("--attach-port", "owner")),
        (("--attach", "127.0.0.1:5555"), KEY, ("tcp://HOST:PORT",)),
        (("--attach", "tcp://127.0.0.1:99999"), KEY, ("tcp://HOST:PORT",)),
        (("--attach", "tcp://127.0.0.1:5555"), None, ("BERTH_ENGINE_KEY",)),
        (("--attach", "tcp://127.0.0.1:5555"), "not-hex", ("BERTH_ENGINE_KEY", "hex")),
        (("MODEL", "--attach-port", "0"), None, ("--attach-port", "BERTH_ENGINE_KEY")),
        (("MODEL", "--attach-port", "0"), "abcd", ("--attach-port", "32 bytes")),
        (("MODEL", "--attach-port", "70000"), KEY, ("--attach-port", "70000")),
        (("MODEL", "--num-postprocess-workers", "-1"), None, ("--num-postprocess-workers",)),
        (("MODEL", "--num-postprocess-workers", "2", "--executor", "in-process"), None, ("proxy executor",)),
    ],
)
def test_attach_and_postprocess_options_are_checked_before_anything_starts(tiny_model, args, key, words):
    args = [str(tiny_model) if arg == "MODEL" else arg for arg in args]
    assert_refused(berth("serve", *args, key=key), *words)


def test_an_attach_port_in_use_is_refused_before_the_model_loads(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = berth("serve", str(tiny_model), "--port", "0", "--attach-port", str(port), key=KEY)
    assert_refused(result, f"127.0.0.1:{port}", "frontends")
    assert "loaded" not in result.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--dtype", "float7"), ("--dtype", "float7")),
        (("--device", "tpu"), ("--device", "tpu")),
        (("--executor", "cloud"), ("--executor",)),
        (("--port", "http"), ("--port",)),
        (("--max-batch-size", "0"), ("max_batch_size",)),
        (("--shutdown-timeout", "-1"), ("--shutdown-timeout",)),
        (("--batch-wait-timeout-ms", "5000"), ("batch_wait_timeout_ms", "1000")),
        (("--batch-wait-max-tokens-ratio", "0.5"), ("batch_wait_max_tokens_ratio", "batch_wait_timeout_ms")),
    ],
)
def test_a_bad_option_is_refused(tiny_model, args, words):
    assert_refused(berth("serve", str(tiny_model), *args), *words)


def test_a_port_in_use_is_refused_before_the_model_loads(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = berth("serve", str(tiny_model), "--port", str(port))
    assert_refused(result, f"127.0.0.1:{port}")
    assert "loaded" not in result.stdout


def test_enforce_eager_is_an_engine_option():
    """`--enforce-eager` (no CUDA graphs for decode steps) reaches EngineConfig as the other
    engine options do; left out, the engine's default stands."""
    from berth.cli import command_parser
    from berth.engine.config import EngineConfig
    from berth.engine.serve.arguments import ENGINE_OPTIONS

    _, parser = command_parser("serve")
    for argv, expected in ((["m", "--enforce-eager"], True), (["m"], False)):
        args = parser.parse_args(argv)
        options = {
            field: getattr(args, flag)
            for flag, field in ENGINE_OPTIONS.items()
            if getattr(args, flag) is not None
        }
        assert EngineConfig(model="m", **options).enforce_eager is expected
