"""Ed25519 signatures over manifests: what a receiver of cache entries (a
bundle, or the fleet cache's entries) checks before it runs their code.

A hash written by the sender proves nothing; a signature by a key that the
receiver was told to trust does. Keys are PEM files: the private key (mode
0600) stays with whoever builds bundles, the public key (``<key>.pub``) is
shipped to every machine that imports them.

A signature is a small JSON document naming the public key that made it, so
that a refusal can say whether the signer is unknown or the manifest altered.

A manifest lists files by name with the sha256 and size of each; bundles and
the fleet cache write the same one::

    >>> members = {"env/aten.abs/key/kernel.so": file_digest(b"...")}
    >>> signature = sign(manifest_of(members), key)
    >>> check_manifest(manifest_of(members), signature, members, [key_pub])   # the signer's fingerprint
    'ed25519:...'
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from aoti_eager.cache.files import load_json


# Bundles wrote it first; the fleet cache's entries carry the same format.
MANIFEST_FORMAT = "aoti_eager bundle 1"


class SignatureError(Exception):
    """Why a manifest is not accepted: unsigned, signed by no trusted key, or a bad signature."""


class KeyFileError(Exception):
    """A key file that cannot be read or is not an ed25519 key of the expected kind."""


def public_key_path(private_key: Path) -> Path:
    return private_key.with_name(private_key.name + ".pub")


def generate_key_pair(private_key: Path) -> str:
    """Writes a new private key to ``private_key`` (mode 0600) and its public
    key to ``<private_key>.pub``; returns the key's fingerprint. Never
    replaces a key."""
    public_key = public_key_path(private_key)
    if public_key.exists():
        raise KeyFileError(f"{public_key} exists: not replacing a key")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        fd = os.open(private_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{private_key} exists: not replacing a key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    public_key.write_bytes(public_pem)
    return fingerprint(key.public_key())


def fingerprint(public_key: Ed25519PublicKey) -> str:
    """A short name for a public key, for messages: ``ed25519:<16 hex digits>``."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


def key_file_fingerprint(path: Path, private: bool = False) -> str:
    """The fingerprint of the key in ``path`` (of its public half, for a private key)."""
    key = _read_key(path, private)
    return fingerprint(key.public_key() if private else key)


def _read_key(path: Path, private: bool):
    kind = "private" if private else "public"
    try:
        data = path.read_bytes()
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except (OSError, ValueError, TypeError) as e:
        raise KeyFileError(f"cannot read the {kind} key {path}: {e}") from None
    if not isinstance(key, Ed25519PrivateKey if private else Ed25519PublicKey):
        raise KeyFileError(f"{path} is not an ed25519 {kind} key (made by `aoti-eager cache keygen`)")
    return key


def sign(manifest: bytes, private_key: Path) -> bytes:
    """A signature of ``manifest`` by the key in ``private_key``."""
    key = _read_key(private_key, private=True)
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return json.dumps({
        "algorithm": "ed25519",
        "public_key": base64.b64encode(public).decode(),
        "signature": base64.b64encode(key.sign(manifest)).decode(),
    }).encode()


def _parse(signature: bytes) -> tuple[Ed25519PublicKey, bytes]:
    try:
        record = load_json(signature)
        signer = Ed25519PublicKey.from_public_bytes(base64.b64decode(record["public_key"], validate=True))
        return signer, base64.b64decode(record["signature"], validate=True)
    except (ValueError, TypeError, KeyError) as e:
        raise SignatureError(f"its signature is unreadable: {e}") from None


def signer(signature: bytes) -> str:
    """The fingerprint of the key that made ``signature`` (nothing verified)."""
    return fingerprint(_parse(signature)[0])


def trusted_signer(manifest: bytes, signature: bytes | None, trusted: Iterable[Path]) -> str:
    """Returns the fingerprint of the trusted key that signed ``manifest``.

    Raises SignatureError saying why it is not accepted (``signature`` None:
    unsigned), KeyFileError for a trusted key that cannot be read.
    """
    if signature is None:
        raise SignatureError("it is not signed")
    key, raw_signature = _parse(signature)
    trusted_keys_read = [_read_key(path, private=False) for path in trusted]
    if not any(trusted_key == key for trusted_key in trusted_keys_read):
        named = ", ".join(fingerprint(k) for k in trusted_keys_read) or "none"
        raise SignatureError(f"it is signed by {fingerprint(key)}, which is not a trusted key (trusted: {named})")
    try:
        key.verify(raw_signature, manifest)
    except InvalidSignature:
        raise SignatureError(f"its signature by {fingerprint(key)} does not match its contents (altered after signing)") from None
    return fingerprint(key)


def file_digest(data: bytes) -> dict:
    """A manifest's record of one file: its sha256 and size."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def manifest_of(members: dict[str, dict], created: float | None = None) -> bytes:
    """The manifest listing ``members`` (name -> :func:`file_digest`), as it
    is signed, with the time its entries were created (now, if not given):
    a receiver can then tell an older signed entry from a newer one."""
    record = {"format": MANIFEST_FORMAT, "members": members, "created": time.time() if created is None else created}
    return json.dumps(record, indent=1, sort_keys=True).encode()


def manifest_created(manifest: bytes) -> float:
    """The creation time a manifest records; 0 (older than any) for a
    manifest written before manifests recorded one, which are accepted as
    they were. Call it on a manifest :func:`check_manifest` accepted."""
    created = load_json(manifest).get("created", 0.0)
    if isinstance(created, bool) or not isinstance(created, (int, float)) or created != created:
        raise SignatureError(f"its manifest's creation time {created!r} is not a time")
    return float(created)


def check_manifest(manifest: bytes | None, signature: bytes | None, members: dict[str, dict],
                   trusted: Iterable[Path]) -> str:
    """The fingerprint of the trusted key that signed ``manifest``, which must
    list exactly ``members`` (name -> :func:`file_digest` of what was received).

    Raises SignatureError saying why not, KeyFileError for a trusted key that
    cannot be read.
    """
    if manifest is None:
        raise SignatureError("it is not signed (no manifest)")
    signed_by = trusted_signer(manifest, signature, trusted)
    try:
        record = load_json(manifest)
        listed = record["members"] if record["format"] == MANIFEST_FORMAT else None
        if not isinstance(listed, dict):
            raise ValueError(f"format {record['format']!r}, not {MANIFEST_FORMAT!r}")
    except (ValueError, TypeError, KeyError) as e:
        raise SignatureError(f"its manifest is unreadable: {e}") from None
    if listed != members:
        differing = sorted(n for n in listed.keys() | members.keys() if listed.get(n) != members.get(n))
        raise SignatureError(f"{len(differing)} members, e.g. {differing[0]!r}, do not match its signed manifest")
    return signed_by
