"""The model-store entry layout: names, what each entry holds, and verified reads of an entry.

An entry (``policy-int8:<version>`` or ``policy-fp16:<version>``) holds its artifact directories plus the
bundle's manifest and golden set: ``policy-int8`` holds ``int8/`` (TorchScript) and, when the build wrote
it, ``int8-vllm/`` (the W8A8 checkpoint vLLM serves); ``policy-fp16`` holds ``fp16/``. Registration
(build/) records the manifest's sha256 in the entry's metadata; a read re-hashes the manifest against that record first, then every file it serves against
the manifest, and refuses files the manifest does not list.
"""

from __future__ import annotations

from pathlib import Path

from typing import Sequence

from policy_bundle.bundle.layout import FP16_DIR, GOLDEN, INT8_DIR, INT8_VLLM_DIR, MANIFEST, SIGNATURE
from policy_bundle.bundle.manifest import BundleVerificationError, read_manifest, sha256_file, verify_files

INT8_MODEL, FP16_MODEL = "policy-int8", "policy-fp16"
SHARED_FILES = (MANIFEST, GOLDEN, SIGNATURE)  # copied at each entry's root beside its artifact directory (if present)
ENTRY_DIRS = {INT8_MODEL: (INT8_DIR, INT8_VLLM_DIR), FP16_MODEL: (FP16_DIR,)}


def entry_dirs(sub: str) -> tuple:
    """The artifact directories an entry holding ``sub`` may hold (each verified when present)."""
    return next((dirs for dirs in ENTRY_DIRS.values() if sub in dirs), (sub,))


def verify_entry(root: Path, sub: str, recorded_sha: str | None, trusted: Sequence[Path] = (),
                 hashed_on_read: Sequence[str] = ()) -> Path:
    """Verify a store entry's ``sub`` directory and its sibling artifact directories; returns ``root / sub``.
    ``hashed_on_read``: entry paths (files or directories) the caller reads only through a reader that hashes what
    it reads against the manifest (``serve/model_entries.py``: ``verified_copy``, ``verified_bytes``); they are checked
    here for presence and size, and hashed once, as they are read.

    ``recorded_sha`` is the manifest sha256 the registration wrote into the entry's metadata: a
    manifest rewritten to match tampered files fails here. With ``trusted`` public keys the manifest must be signed
    by one of them (``bundle.signing``): whoever can write the store can rewrite the recorded hash too, not sign. A
    symlink anywhere in the entry is refused: what is hashed must be what is read."""
    root = Path(root)
    links = [p for p in (root, *root.rglob("*")) if p.is_symlink()]
    if links:
        raise BundleVerificationError(f"{links[0].relative_to(root) if links[0] != root else root}: a symlink in the "
                                      "store entry (refused: it could point anywhere after it was verified)")
    if not recorded_sha:
        raise BundleVerificationError(f"{root}: the store entry records no manifest_sha256 (not registered by "
                                      "policy-bundle build)")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise BundleVerificationError(f"{MANIFEST}: missing from the store entry")
    if sha256_file(manifest_path) != recorded_sha:
        raise BundleVerificationError(f"{MANIFEST}: sha256 differs from the one recorded at registration "
                                      "(manifest was modified)")
    if trusted:
        from policy_bundle.bundle.signing import verify_signature

        verify_signature(root, trusted)
    manifest = read_manifest(root)
    also = [f for f in SHARED_FILES if f != MANIFEST and f in manifest.get("files", {})]
    if not (root / sub).is_dir():
        raise BundleVerificationError(f"{sub}/: not in the store entry")
    dirs = entry_dirs(sub)
    for d in dirs:
        if (root / d).is_dir():
            verify_files(root, manifest, subdir=d, also=also, hashed_on_read=hashed_on_read)
    unexpected = sorted(p.name for p in root.iterdir() if p.name not in (*dirs, *SHARED_FILES)
                        and not p.name.startswith("."))
    unexpected = [n for n in unexpected if n not in ("model.yaml", "README.md")]  # BentoML's own entry files
    if unexpected:
        raise BundleVerificationError(f"{unexpected[0]}: not part of the store entry (file was added)")
    return root / sub


def verified_store_path(tag: str, sub: str, trusted: Sequence[Path] = (), hashed_on_read: Sequence[str] = ()) -> Path:
    """The store entry's ``sub/`` directory after verifying the entry (see ``verify_entry``)."""
    import bentoml

    model = bentoml.models.get(tag)
    return verify_entry(Path(model.path), sub, (model.info.metadata or {}).get("manifest_sha256"), trusted,
                        hashed_on_read)


def _entries(name: str) -> dict:
    """version -> (creation time, manifest sha256 recorded at registration) of every store entry named ``name``."""
    import bentoml

    out = {}
    for model in bentoml.models.list(name):
        info = model.info
        out[str(model.tag.version)] = (info.creation_time, (info.metadata or {}).get("manifest_sha256"))
    return out


def pair_version(requested: str, log=None) -> str:
    """The store version the router and both variants serve: ``requested``, unless it is ``latest``, which BentoML
    resolves for each name on its own. Then: the newest version that both ``policy-int8`` and ``policy-fp16`` hold
    with one manifest, so an entry a killed registration left alone is passed over (``log`` says so, one line) and
    the router starts on the last whole pair instead of refusing until someone deletes it. ``latest`` as it was
    when the store holds no whole pair (the refusal then names the two entries)."""
    if requested != "latest":
        return requested
    try:
        int8, fp16 = _entries(INT8_MODEL), _entries(FP16_MODEL)
    except Exception:  # noqa: BLE001 - no store yet, or unreadable: BentoML's own resolution reports it
        return requested
    paired = [v for v in int8.keys() & fp16.keys() if int8[v][1] and int8[v][1] == fp16[v][1]]
    if not paired:
        return requested
    best = max(paired, key=lambda v: int8[v][0])
    newer = [f"{name}:{v}" for name, entries in ((INT8_MODEL, int8), (FP16_MODEL, fp16)) for v in entries
             if entries[v][0] > entries[best][0] and v not in paired]
    if newer and log is not None:
        log(f"latest: serving {best}, the newest whole INT8/FP16 pair; passed over {', '.join(sorted(newer))}, "
            "which has no partner from its build (a registration interrupted: register the bundle again)")
    return best
