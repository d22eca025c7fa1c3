"""The images (images/Dockerfile, images/Dockerfile.cuda) cannot be built here (no container
engine), so the test kubelet mirrors their steps (tests/support/image.py). These tests keep
the three saying the same, and the images saying what the operator's pods rely on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from berth.operator import naming, render
from tests.support import image

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "images" / "Dockerfile", ROOT / "images" / "Dockerfile.cuda"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), " ".join(rest.split())))
    return result


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_has_what_the_test_kubelet_mirrors(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    copies = [args.split() for keyword, args in steps if keyword == "COPY"]
    for source, target in image.FILES.items():
        assert [source, target] in copies, f"{dockerfile.name} must COPY {source} {target}"
    runs = " && ".join(args for keyword, args in steps if keyword == "RUN")
    assert "openssh-server" in runs
    assert f"useradd --uid {image.UID} --user-group --create-home --shell /bin/bash {image.USER}" in runs
    assert f"usermod --password '*' {image.USER}" in runs
    # No host key in the image: openssh-server's are removed, each worker pod makes its own.
    assert "ssh-keygen" not in runs and "rm -f /etc/ssh/ssh_host_*_key" in runs
    made = re.search(r"mkdir -p ([^&]+)", runs)
    assert made is not None
    assert set(made[1].split()) | {image.HOME} == set(image.DIRECTORIES)  # useradd makes the home
    assert "[mpi" in runs  # mpich's mpirun and hydra from PyPI
    env = " ".join(args for keyword, args in steps if keyword == "ENV")
    assert "PATH=/opt/berth/bin:$PATH" in env  # the venv leads PATH, as image.Image.env does
    # No USER: worker pods start sshd as root; the others run as the image's user.
    assert not any(keyword == "USER" for keyword, _ in steps)
    for source in (args.split()[:-1] for keyword, args in steps if keyword == "COPY"):
        for item in source:
            assert (ROOT / item).exists(), f"{dockerfile.name} copies {item}, which does not exist"


def test_the_cuda_image_pins_every_dependency_at_what_the_gpu_check_ran_with() -> None:
    """images/constraints-cuda.txt: every dependency of berth (and its mpi and triton extras),
    pinned; the engine's at the versions of the committed `make gpu-check` report."""

    def canonical(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    lines = (ROOT / "images" / "constraints-cuda.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    pins = {canonical(name): version for name, version in pins.items()}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = project["dependencies"] + project["optional-dependencies"]["mpi"]
    needed += project["optional-dependencies"]["triton"]
    assert {canonical(Requirement(text).name) for text in needed} <= set(pins)
    report = json.loads((ROOT / "docs" / "gpu-check" / "h200-2026-12-04.json").read_text())
    (environment,) = [check for check in report["checks"] if check["check"] == "environment"]
    for name, version in environment["metrics"]["versions"].items():
        assert pins[canonical(name)].split("+")[0] == version, name
    steps = " ".join(args for _, args in instructions(ROOT / "images" / "Dockerfile.cuda"))
    assert "-c /src/constraints-cuda.txt" in steps


def test_the_users_and_paths_agree_with_the_operator() -> None:
    assert render.POD_USER == image.UID
    sshd = (ROOT / "images" / "sshd_config").read_text()
    assert f"AuthorizedKeysFile {naming.SSH_DIR}/{render.SSH_AUTHORIZED_KEYS}" in sshd
    assert re.search(r"^StrictModes no$", sshd, re.M)  # the Secret's files belong to root
    assert re.search(r"^Port 22$", sshd, re.M) and naming.SSH_PORT == 22
    client = (ROOT / "images" / "ssh_config").read_text()
    assert f"IdentityFile {naming.SSH_DIR}/{render.SSH_PRIVATE_KEY}" in client
    assert naming.HOSTFILE_DIR in image.DIRECTORIES and naming.SSH_DIR in image.DIRECTORIES
    assert str(image.SSHD) == render.SSHD and render.WORKER_COMMAND[-1].endswith(f"exec {image.SSHD} -De")
    assert re.search(r"^PermitRootLogin no$", sshd, re.M)  # mpirun logs in as the image's user
    assert re.search(rf"^HostKey {render.SSH_HOST_KEY}$", sshd, re.M)  # the key the pod makes


def test_the_build_context_leaves_out_what_is_not_the_image() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored)
