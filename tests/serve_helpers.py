"""Serving test helpers: the shared server launcher, a bundle's model-store version, /metrics and SSE readers."""

from __future__ import annotations

from pathlib import Path

from policy_bundle.loadtest.servers import Server, free_port  # noqa: F401 - re-exported for the tests


def bundle_version(bundle: Path) -> str:
    import json

    from policy_bundle.bundle.manifest import manifest_hash

    name = json.loads((bundle / "bundle.json").read_text())["config"]["name"]
    return f"{name}-{manifest_hash(bundle)[:12]}"


def register_into(bundle: Path, home: Path) -> None:
    """Check a built bundle against its manifest and register its two entries in the BentoML store at ``home`` (a
    fresh process: this one's bentoml may already be bound to another store)."""
    import os
    import subprocess
    import sys

    from policy_bundle.bundle.manifest import manifest_hash
    from policy_bundle.loadtest.drill_kit import VERIFY_AND_REGISTER

    reg = subprocess.run([sys.executable, "-c", VERIFY_AND_REGISTER, str(bundle), bundle_version(bundle), manifest_hash(bundle)],
                         env={**os.environ, "BENTOML_HOME": str(home)}, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert reg.returncode == 0, reg.stderr[-2000:]


def metric(server, name: str, **labels) -> float:
    """The sum of ``name``'s series on /metrics whose labels include ``labels``."""
    import re

    import httpx

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def sse_events(response) -> list:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
