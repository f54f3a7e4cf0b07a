"""Register a bundle's two artifacts in the BentoML model store (verified reads: ``bundle.model_store``)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from policy_bundle.bundle.manifest import read_manifest
from policy_bundle.bundle.model_store import ENTRY_DIRS, FP16_MODEL, INT8_MODEL, SHARED_FILES


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
    labels["gate"] = str(manifest.get("gate", {}).get("verdict", "not-run"))
    vllm = manifest.get("fidelity", {}).get("int8_vllm") or {}
    if manifest.get("artifacts", {}).get("int8_vllm") and vllm.get("greedy_agreement") is not None:
        labels["int8_vllm_greedy_agreement"] = f"{vllm['greedy_agreement']:.4f}"
    return labels


def register_bundle(bundle: Path, version: str, manifest_sha: str) -> Registered:
    """Copy ``int8/`` (with ``int8-vllm/`` when built) and ``fp16/``, each entry with the manifest, into the
    store under one version tag."""
    import bentoml

    manifest = read_manifest(bundle)
    labels = _labels(manifest, manifest_sha)
    tags = []
    try:
        for name in (INT8_MODEL, FP16_MODEL):
            subs = [d for d in ENTRY_DIRS[name] if (bundle / d).is_dir()]
            with bentoml.models.create(f"{name}:{version}", labels=labels,
                                       metadata={"manifest_sha256": manifest_sha, "artifact": subs[0]}) as model:
                for sub in subs:
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
