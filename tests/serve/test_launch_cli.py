"""`berth launch`'s command line: the command the operator renders into every launcher pod
parses with the CLI's own parser (so the two cannot drift apart again), the examples'
engineArgs are real flags, and bad arguments are refused with a message before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from berth.cli import command_parser
from berth.operator import naming, render
from berth.operator.crd_model import parse_spec
from tests.serve.test_serve_cli import assert_refused, berth

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "manifests" / "examples").glob("*.yaml"))


def launcher_command(raw_spec: dict) -> list[str]:
    owner = render.Owner(name="llama", namespace="ml", uid="uid-1")
    pod = render.launcher_pod(owner, parse_spec(raw_spec), 0)
    (container,) = pod["spec"]["containers"]
    return container["command"]


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_the_launcher_command_the_operator_renders_parses_with_the_cli_parser(example):
    raw_spec = yaml.safe_load(example.read_text())["spec"]
    command = launcher_command(raw_spec)
    assert command[:2] == ["berth", "launch"]
    _, parser = command_parser("launch")
    args = parser.parse_args(command[2:])  # an unknown flag ends the test here (SystemExit 2)
    spec = parse_spec(raw_spec)
    assert args.model == spec.model.path
    assert args.hostfile == naming.HOSTFILE_PATH
    assert (args.tensor_parallel_size, args.gpus_per_node) == (spec.tensor_parallel_size, spec.gpus_per_node)
    assert (args.host, args.port) == ("0.0.0.0", naming.ENGINE_PORT)
    assert args.served_model_name == spec.served_model_name
    if spec.engine_args:  # the annotated example's --max-num-seqs is vLLM's name of --max-batch-size
        assert args.max_batch_size == 64


def test_every_engine_option_a_spec_may_carry_parses():
    command = launcher_command(
        {
            "model": {"path": "/models/m", "name": "m"},
            "image": "berth:1",
            "tensorParallelSize": 4,
            "gpusPerNode": 2,
            "engineArgs": [
                "--max-num-seqs=8", "--max-num-batched-tokens=512", "--enable-prefix-caching",
                "--dtype=bfloat16", "--kv-cache-memory-fraction=0.8", "--max-model-len", "4096",
                "--scheduling-policy=priority",
            ],
        }
    )  # fmt: skip
    _, parser = command_parser("launch")
    args = parser.parse_args(command[2:])
    assert (args.max_batch_size, args.max_num_tokens, args.prefix_caching) == (8, 512, True)
    assert (args.dtype, args.max_model_len, args.tensor_parallel_size) == ("bfloat16", 4096, 4)


def test_launch_help_names_its_world_options():
    result = berth("launch", "--help")
    assert result.returncode == 0
    for option in (
        "--hostfile",
        "--tensor-parallel-size",
        "--gpus-per-node",
        "--launcher-agent",
        "--ssh-key",
    ):
        assert option in result.stdout
    assert "--max-batch-size" in result.stdout  # and every option of berth serve


@pytest.mark.slow  # `berth launch` of an MPI world
def test_bad_launch_arguments_are_refused_before_anything_starts(tiny_model, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("w0-0.w.default.svc:1\n")
    base = ("launch", str(tiny_model), "--hostfile", str(hostfile))
    assert_refused(berth(*base, "-tp", "2"), "has 1 slots for 2 ranks")
    assert_refused(berth("launch", str(tiny_model), "--hostfile", str(tmp_path / "none")), "--hostfile")
    hostfile.write_text("w0-0 w0-1\n")
    assert_refused(berth(*base), "is not HOST or HOST:SLOTS")
    hostfile.write_text("localhost:1\n")
    assert_refused(berth(*base, "--executor", "in-process"), "MPI world")
    assert_refused(berth(*base, "--attach", "tcp://x:1"), "--attach")
    assert_refused(berth(*base, "--gpus-per-node", "-1"), "--gpus-per-node")
    assert_refused(berth(*base, "--num-postprocess-workers", "2"), "not with berth launch yet")
    assert_refused(berth("launch", str(tiny_model)), "--hostfile")  # required
