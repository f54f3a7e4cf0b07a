"""Serving test helpers: the shared server launcher and a bundle's model-store version."""

from __future__ import annotations

from pathlib import Path

from policy_bundle.loadtest.servers import Server, free_port  # noqa: F401 - re-exported for the tests


def bundle_version(bundle: Path) -> str:
    import json

    from policy_bundle.bundle.manifest import manifest_hash

    name = json.loads((bundle / "bundle.json").read_text())["config"]["name"]
    return f"{name}-{manifest_hash(bundle)[:12]}"
