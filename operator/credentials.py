"""Key material for a deployment: the engine's HMAC key, the admin token, an SSH key pair.

Generated once, when the Secret does not exist yet; a reconcile never regenerates or rotates it
(running worlds hold the old values), and nothing here is ever logged.
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

ENGINE_KEY_BYTES = 32  # HMAC-SHA256 key: as long as the hash
ADMIN_TOKEN_BYTES = 32


@dataclass(frozen=True, repr=False)
class SSHKeyPair:
    private_openssh: str
    public_openssh: str


def new_engine_key() -> str:
    """A random HMAC key, hex-encoded (the engine reads BERTH_ENGINE_KEY as hex)."""
    return secrets.token_hex(ENGINE_KEY_BYTES)


def new_admin_token() -> str:
    """A random bearer token for the engine's /admin endpoints."""
    return secrets.token_urlsafe(ADMIN_TOKEN_BYTES)


def new_ssh_key_pair(comment: str = "berth") -> SSHKeyPair:
    """An Ed25519 key pair in OpenSSH formats: mpirun on the launcher logs in to the workers."""
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    ).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return SSHKeyPair(private_openssh=private, public_openssh=f"{public.decode()} {comment}\n")


def b64(text: str) -> str:
    """Secret `data` values are base64 (stringData is a write-only convenience some servers lack)."""
    return base64.b64encode(text.encode()).decode()


def unb64(data: str) -> str:
    """A Secret's `data` value back to text."""
    return base64.b64decode(data).decode()
