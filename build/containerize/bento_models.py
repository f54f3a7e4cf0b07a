"""Verify the models a bento carries: each store entry re-hashed against the manifest its registration recorded.

Inside an image the entries sit in the bento (``$BENTO_PATH/models/<name>/<version>``); a bento in the local
store keeps only their tags, so those are read from the BentoML model store.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

import yaml

from policy_bundle.bundle.manifest import BundleVerificationError
from policy_bundle.bundle.model_store import verify_entry

BENTO_INFO = "bento.yaml"


@dataclass(frozen=True)
class VerifiedModel:
    tag: str
    manifest_sha256: str
    path: Path


def is_bento(path: Path) -> bool:
    return (Path(path) / BENTO_INFO).is_file()


def _entry_root(bento: Path, tag: str) -> Path:
    name, version = tag.split(":", 1)
    inside = bento / "models" / name / version
    if inside.is_dir():
        return inside
    import bentoml
    from bentoml.exceptions import NotFound

    try:
        return Path(bentoml.models.get(tag).path)
    except NotFound:
        raise BundleVerificationError(f"{tag}: listed in {bento / BENTO_INFO} but neither in {bento}/models nor "
                                      "in the BentoML model store") from None


def verify_bento_models(bento: Path, trusted: Sequence[Path] = ()) -> List[VerifiedModel]:
    """Every model ``bento.yaml`` lists, verified (``bundle.model_store.verify_entry``, signed by one of ``trusted`` when
    given); raises on the first mismatch."""
    bento = Path(bento)
    tags = [m["tag"] for m in (yaml.safe_load((bento / BENTO_INFO).read_text()).get("models") or [])]
    if not tags:
        raise BundleVerificationError(f"{bento / BENTO_INFO}: lists no models")
    verified = []
    for tag in tags:
        root = _entry_root(bento, tag)
        meta = (yaml.safe_load((root / "model.yaml").read_text()) or {}).get("metadata") or {}
        sha = meta.get("manifest_sha256")
        try:
            verify_entry(root, str(meta.get("artifact", "")), sha, trusted)
        except BundleVerificationError as exc:
            raise BundleVerificationError(f"{tag}: {exc}") from None
        verified.append(VerifiedModel(tag, str(sha), root))
    return verified
