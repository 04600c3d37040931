"""Signatures over manifests (aoti_eager.cache.signing): key pairs, and which
signatures a receiver accepts. Bundles that carry them: tests/test_bundle.py."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from aoti_eager.cache import signing


def altered(signature: bytes, /, **fields: str) -> bytes:
    """``signature`` with some of its JSON fields replaced."""
    return json.dumps({**json.loads(signature), **fields}).encode()


def test_signing_says_why_a_manifest_is_refused(key, tmp_path):
    signature = signing.sign(b"manifest", key)
    assert signing.trusted_signer(b"manifest", signature, [Path(f"{key}.pub")]) == signing.signer(signature)
    signing.generate_key_pair(tmp_path / "other")
    for manifest, signature_given, trusted, why in [
        (b"manifest", None, [Path(f"{key}.pub")], "not signed"),
        (b"manifest", signature, [tmp_path / "other.pub"], "not a trusted key"),
        (b"manifest!", signature, [Path(f"{key}.pub")], "does not match its contents"),
        (b"manifest", b"{}", [Path(f"{key}.pub")], "unreadable"),
    ]:
        with pytest.raises(signing.SignatureError, match=why):
            signing.trusted_signer(manifest, signature_given, trusted)



def test_the_signer_is_named_by_the_fingerprint_its_key_pair_was_made_with(key, tmp_path):
    made = signing.generate_key_pair(tmp_path / "team")
    signature = signing.sign(b"manifest", tmp_path / "team")
    assert signing.trusted_signer(b"manifest", signature, [Path(f"{key}.pub"), tmp_path / "team.pub"]) == made
    assert signing.signer(signature) == made != signing.signer(signing.sign(b"manifest", key))


def test_a_signature_altered_after_signing_is_refused(key):
    signature = signing.sign(b"manifest", key)
    raw = bytearray(base64.b64decode(json.loads(signature)["signature"]))
    raw[0] ^= 1
    with pytest.raises(signing.SignatureError, match="does not match its contents"):
        signing.trusted_signer(b"manifest", altered(signature, signature=base64.b64encode(raw).decode()), [Path(f"{key}.pub")])


def test_a_signature_that_names_a_trusted_key_it_was_not_made_with_is_refused(key, tmp_path):
    signing.generate_key_pair(tmp_path / "other")
    trusted_key = json.loads(signing.sign(b"manifest", key))["public_key"]
    forged = altered(signing.sign(b"manifest", tmp_path / "other"), public_key=trusted_key)
    with pytest.raises(signing.SignatureError, match="does not match its contents"):
        signing.trusted_signer(b"manifest", forged, [Path(f"{key}.pub")])


@pytest.mark.parametrize("existing", ["private", "public"])
def test_half_a_key_pair_is_not_completed(tmp_path, existing):
    signing.generate_key_pair(tmp_path / "key")
    (tmp_path / ("key.pub" if existing == "private" else "key")).unlink()
    kept = (tmp_path / ("key" if existing == "private" else "key.pub")).read_bytes()
    with pytest.raises(signing.KeyFileError, match="not replacing a key"):
        signing.generate_key_pair(tmp_path / "key")
    assert [p.read_bytes() for p in tmp_path.iterdir()] == [kept]


def test_a_key_file_of_another_kind_is_refused(key, tmp_path):
    other_algorithm = tmp_path / "p256.pub"
    other_algorithm.write_bytes(ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    signature = signing.sign(b"manifest", key)
    for trusted, why in [(other_algorithm, "not an ed25519 public key"), (key, "cannot read the public key"),
                         (tmp_path / "missing.pub", "cannot read the public key")]:
        with pytest.raises(signing.KeyFileError, match=why):
            signing.trusted_signer(b"manifest", signature, [trusted])
    with pytest.raises(signing.KeyFileError, match="cannot read the private key"):
        signing.sign(b"manifest", Path(f"{key}.pub"))
