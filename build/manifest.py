"""The bundle manifest (bundle.json): sha256 and size of every file, and verification against it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Dict, Iterable, Optional

MANIFEST = "bundle.json"


class BundleVerificationError(RuntimeError):
    """A bundle file is missing, extra, or differs from its manifest entry."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_tree(root: Path, exclude: Iterable[str] = (MANIFEST,)) -> Dict[str, Dict[str, object]]:
    skip = set(exclude)
    files = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in skip:
            files[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return files


def write_manifest(root: Path, body: dict) -> str:
    """Write bundle.json with a ``files`` table over everything under ``root``; returns its sha256."""
    manifest = {**body, "files": hash_tree(root)}
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    (root / MANIFEST).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise BundleVerificationError(f"{root}: no {MANIFEST} (not a bundle, or an interrupted build)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BundleVerificationError(f"{path}: not valid JSON ({exc})") from None


def manifest_hash(root: Path) -> str:
    return sha256_file(Path(root) / MANIFEST)


def verify_files(root: Path, manifest: dict, subdir: Optional[str] = None) -> int:
    """Re-hash every file the manifest lists (only those under ``subdir`` when given).

    Raises naming the first file that is missing, changed in size or content, or not in the
    manifest. Returns the number of files checked.
    """
    root = Path(root)
    listed = manifest.get("files", {})
    prefix = f"{subdir.rstrip('/')}/" if subdir else ""
    checked = 0
    for rel, entry in sorted(listed.items()):
        if not rel.startswith(prefix):
            continue
        path = root / rel
        if not path.is_file():
            raise BundleVerificationError(f"{rel}: missing from the bundle")
        if path.stat().st_size != entry["size"]:
            raise BundleVerificationError(f"{rel}: size {path.stat().st_size} != manifest {entry['size']}")
        if sha256_file(path) != entry["sha256"]:
            raise BundleVerificationError(f"{rel}: sha256 differs from the manifest (file was modified)")
        checked += 1
    if subdir is None:
        extra = sorted(set(hash_tree(root)) - set(listed))
        if extra:
            raise BundleVerificationError(f"{extra[0]}: not listed in the manifest (file was added)")
    return checked


def verify_bundle(root: Path) -> int:
    return verify_files(Path(root), read_manifest(root))
