"""The model-store entry layout: names, what each entry holds, and verified reads of an entry.

An entry (``policy-int8:<version>`` or ``policy-fp16:<version>``) holds its artifact directories plus the
bundle's manifest and golden set: ``policy-int8`` holds ``int8/`` (TorchScript) and, when the build wrote
it, ``int8-vllm/`` (the W8A8 checkpoint vLLM serves); ``policy-fp16`` holds ``fp16/``. Registration
(build/) records the manifest's sha256 in the entry's metadata; a read re-hashes the manifest against that record first, then every file it serves against
the manifest, and refuses files the manifest does not list.
"""

from __future__ import annotations

from pathlib import Path

from policy_bundle.bundle.layout import FP16_DIR, GOLDEN, INT8_DIR, INT8_VLLM_DIR, MANIFEST
from policy_bundle.bundle.manifest import BundleVerificationError, read_manifest, sha256_file, verify_files

INT8_MODEL, FP16_MODEL = "policy-int8", "policy-fp16"
SHARED_FILES = (MANIFEST, GOLDEN)  # copied at each entry's root beside its artifact directory
ENTRY_DIRS = {INT8_MODEL: (INT8_DIR, INT8_VLLM_DIR), FP16_MODEL: (FP16_DIR,)}


def entry_dirs(sub: str) -> tuple:
    """The artifact directories an entry holding ``sub`` may hold (each verified when present)."""
    return next((dirs for dirs in ENTRY_DIRS.values() if sub in dirs), (sub,))


def verify_entry(root: Path, sub: str, recorded_sha: str | None) -> Path:
    """Verify a store entry's ``sub`` directory and its sibling artifact directories; returns ``root / sub``.

    ``recorded_sha`` is the manifest sha256 the registration wrote into the entry's metadata: a
    manifest rewritten to match tampered files fails here."""
    root = Path(root)
    if not recorded_sha:
        raise BundleVerificationError(f"{root}: the store entry records no manifest_sha256 (not registered by "
                                      "policy-bundle build)")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise BundleVerificationError(f"{MANIFEST}: missing from the store entry")
    if sha256_file(manifest_path) != recorded_sha:
        raise BundleVerificationError(f"{MANIFEST}: sha256 differs from the one recorded at registration "
                                      "(manifest was modified)")
    manifest = read_manifest(root)
    also = [f for f in SHARED_FILES if f != MANIFEST and f in manifest.get("files", {})]
    if not (root / sub).is_dir():
        raise BundleVerificationError(f"{sub}/: not in the store entry")
    dirs = entry_dirs(sub)
    for d in dirs:
        if (root / d).is_dir():
            verify_files(root, manifest, subdir=d, also=also)
    unexpected = sorted(p.name for p in root.iterdir() if p.name not in (*dirs, *SHARED_FILES)
                        and not p.name.startswith("."))
    unexpected = [n for n in unexpected if n not in ("model.yaml", "README.md")]  # BentoML's own entry files
    if unexpected:
        raise BundleVerificationError(f"{unexpected[0]}: not part of the store entry (file was added)")
    return root / sub


def verified_store_path(tag: str, sub: str) -> Path:
    """The store entry's ``sub/`` directory after verifying the entry (see ``verify_entry``)."""
    import bentoml

    model = bentoml.models.get(tag)
    return verify_entry(Path(model.path), sub, (model.info.metadata or {}).get("manifest_sha256"))
