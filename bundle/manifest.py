"""The bundle manifest (bundle.json): sha256 and size of every file, and verification against it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Dict, Iterable, Optional

from policy_bundle.bundle.layout import MANIFEST, SIGNATURE

FORMAT = "policy-bundle/1"  # the manifest's ``format``: what this project's build writes


class BundleVerificationError(RuntimeError):
    """A bundle file is missing, extra, or differs from its manifest entry."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_tree(root: Path, exclude: Iterable[str] = (MANIFEST, SIGNATURE)) -> Dict[str, Dict[str, object]]:
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


def safe_relpath(rel: str) -> str:
    """A manifest path is relative and stays inside the bundle: no absolute path, no ``..``, no backslash."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or \
            any(part in ("", ".", "..") for part in rel.split("/")):
        raise BundleVerificationError(f"{rel!r}: not a relative path inside the bundle (manifest refused)")
    return rel


def verify_file(root: Path, rel: str, entry: object, hash_it: bool = True) -> Path:
    """The file at ``rel`` under ``root`` after checking its size and sha256 (unless not ``hash_it``: its reader
    hashes it) against its manifest ``entry``."""
    if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or not isinstance(entry.get("sha256"), str):
        raise BundleVerificationError(f"{rel}: manifest entry has no size/sha256")
    path = Path(root) / rel
    if not path.is_file():
        raise BundleVerificationError(f"{rel}: missing from the bundle")
    if path.stat().st_size != entry["size"]:
        raise BundleVerificationError(f"{rel}: size {path.stat().st_size} != manifest {entry['size']}")
    if hash_it and sha256_file(path) != entry["sha256"]:
        raise BundleVerificationError(f"{rel}: sha256 differs from the manifest (file was modified)")
    return path


def verified_artifact(root: Path, manifest: dict, key: str) -> Path:
    """The file ``artifacts.<key>`` names, before anything loads it: a relative path inside the bundle
    (``safe_relpath``, and no symlink out of it), listed in the manifest's file table, unchanged."""
    rel = (manifest.get("artifacts") or {}).get(key)
    if not isinstance(rel, str):
        raise BundleVerificationError(f"artifacts.{key}: the manifest names no such artifact")
    try:
        safe_relpath(rel)
    except BundleVerificationError:
        raise BundleVerificationError(f"artifacts.{key}: {rel!r} is not a relative path inside the bundle "
                                      "(manifest refused, nothing loaded)") from None
    listed = manifest.get("files")
    if not isinstance(listed, dict) or rel not in listed:
        raise BundleVerificationError(f"artifacts.{key}: {rel!r} is not listed in the manifest's files "
                                      "(manifest refused, nothing loaded)")
    root = Path(root)
    if not (root / rel).resolve().is_relative_to(root.resolve()):
        raise BundleVerificationError(f"artifacts.{key}: {rel!r} leads out of the bundle (a symlink; nothing loaded)")
    return verify_file(root, rel, listed[rel])


def verify_files(root: Path, manifest: dict, subdir: Optional[str] = None, also: Iterable[str] = (),
                 hashed_on_read: Iterable[str] = ()) -> int:
    """Re-hash every file the manifest lists (only those under ``subdir``, plus the files named in
    ``also``, when ``subdir`` is given). A file at or under a path of ``hashed_on_read`` is checked for presence and
    size only: its reader hashes the bytes it reads against the manifest (a private verified copy, ``verified_bytes``),
    so the file is read once, not twice.

    Raises naming the first file that is missing, changed in size or content, not in the manifest
    (anywhere, or under ``subdir``), or listed under a path that leaves the bundle. Returns the
    number of files checked.
    """
    root = Path(root)
    listed = manifest.get("files", {})
    if not isinstance(listed, dict):
        raise BundleVerificationError("files: the manifest's file table is not a mapping")
    for rel in listed:
        safe_relpath(rel)
    prefix = f"{subdir.rstrip('/')}/" if subdir else ""
    wanted = set(also)
    checked = 0
    later = tuple(p.rstrip("/") for p in hashed_on_read)
    for rel, entry in sorted(listed.items()):
        if not (rel.startswith(prefix) or rel in wanted):
            continue
        verify_file(root, rel, entry, hash_it=not any(rel == p or rel.startswith(p + "/") for p in later))
        checked += 1
    missing = sorted(wanted - set(listed))
    if missing:
        raise BundleVerificationError(f"{missing[0]}: not listed in the manifest")
    present = _relative_files(root / subdir if subdir else root, prefix)
    extra = sorted(present - set(listed))
    if extra:
        raise BundleVerificationError(f"{extra[0]}: not listed in the manifest (file was added)")
    return checked


def _relative_files(top: Path, prefix: str) -> set:
    """Every file (and symlink) under ``top``, as manifest paths (``prefix`` + path below ``top``)."""
    return {prefix + p.relative_to(top).as_posix() for p in top.rglob("*")
            if (p.is_file() or p.is_symlink()) and (prefix or p.relative_to(top).as_posix() not in (MANIFEST, SIGNATURE))}


def verify_bundle(root: Path) -> int:
    return verify_files(Path(root), read_manifest(root))
