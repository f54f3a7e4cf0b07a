"""Register a bundle's two artifacts in the BentoML model store (verified reads: ``bundle.store``)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from policy_bundle.bundle.manifest import read_manifest
from policy_bundle.bundle.store import FP16_MODEL, INT8_MODEL, SHARED_FILES


@dataclass(frozen=True)
class Registered:
    int8_tag: str
    fp16_tag: str


def _labels(manifest: dict, manifest_sha: str) -> Dict[str, str]:
    fid = manifest.get("fidelity", {}).get("int8_torchscript", {})
    labels = {"manifest_sha256": manifest_sha[:32], "build": str(manifest.get("config", {}).get("name", ""))}
    for key in ("top1_agreement", "kl_mean", "reward_candidate", "reward_reference"):
        if fid.get(key) is not None:
            labels[key] = f"{fid[key]:.4f}"
    labels["canary"] = str(manifest.get("canary", {}).get("verdict", "not-run"))
    return labels


def register_bundle(bundle: Path, version: str, manifest_sha: str) -> Registered:
    """Copy ``int8/`` and ``fp16/`` (each with the manifest) into the store under one version tag."""
    import bentoml

    manifest = read_manifest(bundle)
    labels = _labels(manifest, manifest_sha)
    tags = []
    try:
        for name, sub in ((INT8_MODEL, "int8"), (FP16_MODEL, "fp16")):
            with bentoml.models.create(f"{name}:{version}", labels=labels,
                                       metadata={"manifest_sha256": manifest_sha, "artifact": sub}) as model:
                shutil.copytree(bundle / sub, Path(model.path) / sub)
                for f in SHARED_FILES:
                    if (bundle / f).is_file():
                        shutil.copy(bundle / f, Path(model.path) / f)
            tags.append(str(model.tag))
    except BaseException:
        for tag in tags:  # never leave one half of the pair registered
            bentoml.models.delete(tag)
        raise
    return Registered(int8_tag=tags[0], fp16_tag=tags[1])
