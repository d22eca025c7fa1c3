"""`berth serve` refuses bad arguments with a message and exit code 2, never a traceback, and
before loading anything; `berth --help` lists every command."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from berth.cli import COMMANDS


def berth(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "berth", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
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


def test_attach_is_refused_as_not_supported(tiny_model):
    assert_refused(berth("serve", str(tiny_model), "--attach", "tcp://127.0.0.1:5555"), "--attach")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--dtype", "float7"), ("--dtype", "float7")),
        (("--device", "tpu"), ("--device", "tpu")),
        (("--executor", "cloud"), ("--executor",)),
        (("--port", "http"), ("--port",)),
        (("--max-batch-size", "0"), ("max_batch_size",)),
        (("--shutdown-timeout", "-1"), ("--shutdown-timeout",)),
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
