"""Who built a bundle: an Ed25519 signature over its manifest's exact bytes, checked against keys the reader trusts.

The manifest's file table already pins every artifact's sha256, so a signature over ``bundle.json`` covers the whole
bundle; it lives beside it in ``bundle.json.sig`` (JSON: algorithm, the key's id, the base64 signature), outside the
file table. The integrity check alone (the manifest hash recorded in the store entry's own ``model.yaml``) stops an
accident, not someone who can write the store: they can rewrite all three. A key that person does not hold can.

Keys are PEM files: ``generate_key`` writes a private key (mode 0600) and its public key beside it (``.pub``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Sequence

from policy_bundle.bundle.layout import MANIFEST, SIGNATURE
from policy_bundle.bundle.manifest import BundleVerificationError

ALGORITHM = "ed25519"
SIGNING_KEY_ENV = "POLICY_BUNDLE_SIGNING_KEY"  # the private key a build signs its manifest with (unset: unsigned)


class SigningKeyError(ValueError):
    """A key file that is missing or not an Ed25519 key of the kind asked for (private or public)."""


def _serialization():
    from cryptography.hazmat.primitives import serialization

    return serialization


def generate_key(out: Path) -> Path:
    """A new private key at ``out`` (PEM, readable by its owner only) and its public key at ``out`` + ``.pub``;
    returns the public key's path. Refuses to overwrite either."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    ser, out = _serialization(), Path(out)
    pub = out.with_name(out.name + ".pub")
    for p in (out, pub):
        if p.exists():
            raise SigningKeyError(f"--out: {p} exists; keys are never overwritten")
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    pub.write_bytes(key.public_key().public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo))
    return pub


def load_key(path: Path, private: bool):
    """The Ed25519 key at ``path`` (PEM), private or public; ``SigningKeyError`` naming the file otherwise."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    ser, kind = _serialization(), "private" if private else "public"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SigningKeyError(f"{path}: cannot read the {kind} key ({exc.strerror})") from None
    try:
        key = ser.load_pem_private_key(data, None) if private else ser.load_pem_public_key(data)
    except (ValueError, TypeError):
        raise SigningKeyError(f"{path}: not a PEM {kind} key") from None
    if not isinstance(key, Ed25519PrivateKey if private else Ed25519PublicKey):
        raise SigningKeyError(f"{path}: not an Ed25519 {kind} key")
    return key


def signing_key_from_env() -> Optional[Path]:
    """The private key ``POLICY_BUNDLE_SIGNING_KEY`` names, checked now (a build refuses a bad key before it starts,
    not after its last stage); None when it is unset."""
    raw = os.environ.get(SIGNING_KEY_ENV, "").strip()
    if not raw:
        return None
    try:
        load_key(Path(raw), private=True)
    except SigningKeyError as exc:
        raise SigningKeyError(f"{SIGNING_KEY_ENV}: {exc}") from None
    return Path(raw)


def key_id(public_key) -> str:
    """The first 16 hex digits of the sha256 of the public key's raw bytes: what a signature names."""
    ser = _serialization()
    return hashlib.sha256(public_key.public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)).hexdigest()[:16]


def sign_bundle(root: Path, private_key: Path) -> str:
    """Sign ``root``'s manifest with the key at ``private_key``; writes ``bundle.json.sig``, returns the key's id."""
    key = load_key(private_key, private=True)
    data = (Path(root) / MANIFEST).read_bytes()
    kid = key_id(key.public_key())
    sig = {"algorithm": ALGORITHM, "key_id": kid, "signature": base64.b64encode(key.sign(data)).decode()}
    (Path(root) / SIGNATURE).write_text(json.dumps(sig) + "\n")
    return kid


def verify_signature(root: Path, trusted: Sequence[Path]) -> str:
    """The id of the trusted key that signed ``root``'s manifest; ``BundleVerificationError`` (one line) when it is
    unsigned, signed by a key not in ``trusted``, or its signature does not match the manifest's bytes."""
    from cryptography.exceptions import InvalidSignature

    keys = {key_id(k): k for k in (load_key(p, private=False) for p in trusted)}
    path = Path(root) / SIGNATURE
    if path.is_symlink() or not path.is_file():
        raise BundleVerificationError(f"{SIGNATURE}: missing: the bundle is unsigned, and this reader trusts only "
                                      f"bundles signed by {', '.join(sorted(keys))}")
    try:
        sig = json.loads(path.read_text())
        kid, raw = sig["key_id"], base64.b64decode(sig["signature"], validate=True)
        if sig.get("algorithm") != ALGORITHM:
            raise ValueError(sig.get("algorithm"))
    except (ValueError, KeyError, TypeError):
        raise BundleVerificationError(f"{SIGNATURE}: not an {ALGORITHM} signature file") from None
    if kid not in keys:
        raise BundleVerificationError(f"{SIGNATURE}: signed by key {kid}, which this reader does not trust "
                                      f"(trusted: {', '.join(sorted(keys))})")
    try:
        keys[kid].verify(raw, (Path(root) / MANIFEST).read_bytes())
    except InvalidSignature:
        raise BundleVerificationError(f"{SIGNATURE}: the signature of key {kid} does not match {MANIFEST} "
                                      "(the manifest was changed after it was signed)") from None
    return kid
