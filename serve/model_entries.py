"""The router's and the variants' store entries: each artifact re-hashed against the manifest recorded at
registration before it loads, and the INT8/FP16 pair checked to come from one build."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

import bentoml

from policy_bundle.bundle.manifest import BundleVerificationError
from policy_bundle.bundle.model_store import verified_store_path
from policy_bundle.serve.rollout.state import BundlePair

log = logging.getLogger("policy_bundle.serve")


def refuse(message: str) -> None:
    log.error("refusing to start: %s", message)
    raise SystemExit(f"policy-bundle: {message}")


def verified_artifact(model: bentoml.models.BentoModel, sub: str, trusted: Sequence[str] = (),
                      hashed_on_read: Sequence[str] = ()) -> Path:
    """The store entry's artifact dir, verified against the manifest recorded at registration (and signed by one of
    the ``trusted`` public keys, when any is set). ``hashed_on_read``: the entry paths the caller reads only through
    ``verified_copy`` / ``verified_bytes``, which hash them as they read (``bundle.model_store.verify_entry``)."""
    try:
        return verified_store_path(str(model.tag), sub, [Path(k) for k in trusted], hashed_on_read)
    except BundleVerificationError as exc:
        log.error("refusing to start: %s does not match its manifest: %s", model.tag, exc)
        raise SystemExit(f"policy-bundle: {model.tag} failed verification: {exc}") from None


def verified_bytes(root: Path, rel: str) -> bytes:
    """The file ``rel`` of a verified entry read once and checked against its manifest entry: what loads is the bytes
    that were hashed, not the path re-opened (a file swapped between the check and the load)."""
    import hashlib

    from policy_bundle.bundle.manifest import read_manifest

    entry = read_manifest(root).get("files", {}).get(rel) or {}
    data = (Path(root) / rel).read_bytes()
    if len(data) != entry.get("size") or hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        refuse(f"{rel}: changed after it was verified (its bytes no longer match the manifest)")
    return data


def verified_copy(root: Path, sub: str) -> Path:
    """``root/sub`` copied into a directory only this process may write (0700, removed at exit), each file hashed
    as it is copied and checked against the manifest: an engine that opens its files by path (vLLM, the HF loader)
    then reads the bytes that were hashed, whatever happens to the store entry afterwards. What it costs: the
    directory's size on the temporary disk (``TMPDIR``). Used with trusted keys (signed bundles)."""
    import atexit
    import hashlib
    import os
    import shutil
    import tempfile

    from policy_bundle.bundle.manifest import read_manifest

    files = {rel: e for rel, e in read_manifest(root).get("files", {}).items() if rel.startswith(f"{sub}/")}
    _remove_stale_copies(Path(tempfile.gettempdir()))
    dest = Path(tempfile.mkdtemp(prefix=f"policy-bundle-copy-{os.getpid()}-"))
    atexit.register(shutil.rmtree, dest, True)
    for rel, entry in sorted(files.items()):
        target = dest / rel[len(sub) + 1:]
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        fd = os.open(Path(root) / rel, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as src, open(target, "wb") as out:
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        if size != entry.get("size") or digest.hexdigest() != entry.get("sha256"):
            shutil.rmtree(dest, ignore_errors=True)
            refuse(f"{rel}: changed after it was verified (its bytes no longer match the manifest)")
    log.info("%s/ loaded from a private copy of its verified bytes (%s)", sub, dest)
    return dest


def _remove_stale_copies(tmp: Path) -> None:
    """Remove the verified copies of processes that are gone (killed: their ``atexit`` never ran), so restarts do not
    fill the temporary disk with model copies."""
    import os
    import re
    import shutil

    for d in tmp.glob("policy-bundle-copy-*"):
        m = re.fullmatch(r"policy-bundle-copy-(\d+)-.*", d.name)
        if not m or not d.is_dir():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:  # gone: its copy is nobody's
            shutil.rmtree(d, ignore_errors=True)
            log.info("removed %s, the verified copy of a process that is gone", d)
        except PermissionError:  # alive, another user's
            continue


def manifest_sha(model: bentoml.models.BentoModel) -> Optional[str]:
    """The manifest sha256 the store entry recorded at registration."""
    return (bentoml.models.get(str(model.tag)).info.metadata or {}).get("manifest_sha256")


def bundle_pair(int8_model: bentoml.models.BentoModel, fp16_model: bentoml.models.BentoModel) -> BundlePair:
    """The pair the router serves, keyed by manifest sha256: INT8 and FP16 must come from one build (``latest``
    resolves each name on its own, so a build registered half-way, or a hand-picked version, can split them)."""
    shas = {}
    for model in (int8_model, fp16_model):
        entry = bentoml.models.get(str(model.tag))
        shas[entry.tag.name] = (manifest_sha(model), entry.tag)
    (i_sha, i_tag), (f_sha, f_tag) = shas["policy-int8"], shas["policy-fp16"]
    if not i_sha or i_sha != f_sha:
        refuse(f"{i_tag} and {f_tag} come from different builds (manifest sha256 {str(i_sha)[:12]} vs "
               f"{str(f_sha)[:12]}): serve one bundle's pair (POLICY_BUNDLE_VERSION=<name>-<hash>)")
    return BundlePair(i_sha, f_sha, label=str(i_tag.version))
