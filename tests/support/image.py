"""The container image's contents, for the test kubelet: the steps of images/Dockerfile, done
into a directory that the kubelet lays over this machine's /etc, /home and /run in each pod.

The Dockerfile cannot be built here (no container engine), so its steps are mirrored instead,
from the same files, and tests/operator/test_images.py checks that both say the same:

  Dockerfile                                   here
  apt-get install openssh-server               /usr/sbin/sshd of this machine (make setup)
  pip install berth[mpi] into /opt/berth       the test venv (its bin/ leads the pods' PATH)
  useradd --uid 1000 berth, password '*'       passwd / group / shadow entries in the layer
  COPY images/sshd_config, images/ssh_config   the same files, to the same paths
  mkdir /run/sshd /etc/berth/...               the same directories in the layer
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SSHD = Path("/usr/sbin/sshd")
USER, UID = "berth", 1000
HOME = f"/home/{USER}"
# repository file -> path in the image (the Dockerfiles COPY exactly these).
FILES = {
    "images/sshd_config": "/etc/ssh/sshd_config.d/berth.conf",
    "images/ssh_config": "/etc/ssh/ssh_config.d/berth.conf",
}
# Directories the image creates: sshd's privilege separation directory, where a worker makes its
# host key (this machine's own host keys in /etc/ssh are never used), the mount points of the
# operator's volumes, the user's home.
DIRECTORIES = ("/run/sshd", "/etc/ssh/berth", "/etc/berth/ssh", "/etc/berth/hostfile", HOME)
# Machine directories the layer is laid over (copy-on-write, per container).
LAYERED = ("/etc", "/home", "/run")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ImageSetupError(RuntimeError):
    pass


@dataclass(frozen=True)
class Image:
    root: Path  # the layer: ROOT/etc, ROOT/home, ROOT/run (and ROOT/root, see _opened_for_users)
    layered: tuple[str, ...] = LAYERED

    @property
    def env(self) -> dict[str, str]:
        """The image's ENV: its Python environment (with berth and mpich's mpirun) first on PATH."""
        return {"PATH": f"{Path(sys.executable).parent}:{SYSTEM_PATH}", "LANG": "C.UTF-8"}

    @property
    def under_machine_tmp(self) -> list[str]:
        """What pods run from this machine that lies under its /tmp: the test's Python (venv and
        interpreter) and berth's source tree (an editable install). A container's /tmp is its own,
        empty: the kubelet binds these back in at the same paths, so a checkout cloned into /tmp
        serves its pods as one anywhere else does."""
        import berth

        tmp = Path("/tmp")
        needed = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent.parent}
        needed.add(Path(berth.__file__).resolve().parent.parent)
        under = sorted(path.resolve() for path in needed if tmp in path.resolve().parents)
        # Only the outermost: a venv inside the checkout comes with it.
        return [str(p) for p in under if not any(other in p.parents for other in under)]

    def layers(self) -> dict[str, Path]:
        """machine directory -> the layer's directory laid over it."""
        return {target: self.root / target.lstrip("/") for target in self.layered}

    def home_of(self, uid: int) -> str:
        for line in (self.root / "etc" / "passwd").read_text().splitlines():
            fields = line.split(":")
            if len(fields) >= 6 and fields[2] == str(uid):
                return fields[5]
        return "/"


def _with_entry(machine_file: Path, entry: str, same_id: bool = True) -> str:
    """The machine's file with `entry` in place of any entry of the same name (or id: the
    image's user owns its uid, whoever has it on this machine)."""
    lines = machine_file.read_text().splitlines() if machine_file.exists() else []
    fields = entry.split(":")

    def clashes(line: str) -> bool:
        other = line.split(":")
        return other[0] == fields[0] or (same_id and len(other) > 2 and other[2] == fields[2])

    return "\n".join([line for line in lines if not clashes(line)] + [entry]) + "\n"


def _opened_for_users() -> list[str]:
    """Top-level directories on the way to this Python that other users cannot enter.

    In the image, Python lives where its non-root user runs it (/usr/local, /opt/berth). Here the
    interpreter may sit under /root (mode 0700, e.g. pyenv): the layer then carries that directory
    with mode 0711, so pods see it enterable while this machine's /root stays as it is.
    """
    opened = []
    for path in {Path(sys.executable).resolve(), Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}:
        for ancestor in [*reversed(path.parents), path][1:]:
            if ancestor.is_dir() and not ancestor.stat().st_mode & 0o001:
                if ancestor.parent != Path("/"):
                    raise ImageSetupError(
                        f"{ancestor} (on the way to {path}) is closed to other users and is no top-level "
                        "directory the test image can open: install Python where every user can run it"
                    )
                opened.append(str(ancestor))
    return sorted(set(opened))


def build_image(root: Path) -> Image:
    if not SSHD.exists():
        raise ImageSetupError(
            f"{SSHD} is missing: the worker pods run the image's sshd. Install openssh-server "
            "with the project's setup step (`make setup`)."
        )
    if shutil.which("mpirun", path=str(Path(sys.executable).parent)) is None:
        raise ImageSetupError("mpich's mpirun is not in the test venv: pip install -e '.[dev]'")
    etc = root / "etc"
    for directory in LAYERED:
        (root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
    # useradd --uid 1000 --user-group --create-home berth; usermod --password '*' berth
    # ('*': no password, but not locked: sshd refuses logins to locked accounts).
    (etc / "passwd").write_text(_with_entry(Path("/etc/passwd"), f"{USER}:x:{UID}:{UID}::{HOME}:/bin/bash"))
    (etc / "group").write_text(_with_entry(Path("/etc/group"), f"{USER}:x:{UID}:"))
    (etc / "shadow").write_text(
        _with_entry(Path("/etc/shadow"), f"{USER}:*:20000:0:99999:7:::", same_id=False)
    )
    os.chmod(etc / "shadow", 0o640)
    for source, target in FILES.items():
        destination = root / target.lstrip("/")
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / source, destination)
        os.chmod(destination, 0o644)
    for directory in DIRECTORIES:
        (root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "run" / "sshd", 0o755)
    opened = _opened_for_users()
    for directory in opened:
        layer = root / directory.lstrip("/")
        layer.mkdir(exist_ok=True)
        os.chmod(layer, 0o711)
    os.chown(root / HOME.lstrip("/"), UID, UID)
    # No host keys: the worker's command makes its own when the pod starts.
    (etc / "ssh").mkdir(exist_ok=True)
    return Image(root, layered=(*LAYERED, *opened))
