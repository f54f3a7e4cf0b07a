"""The local base image: Debian bookworm's python3 (3.11) from Debian's packages, with this machine's CA bundle.

No public base image can be pulled here, so ``mmdebstrap`` builds a root filesystem from Debian's archive and
``podman import`` makes it an image. The host's CA bundle goes in (package downloads pass through a proxy that
presents its own CA) and ``SSL_CERT_FILE``/``PIP_CERT`` point pip and uv at it. Debian marks its python3
externally managed; BentoML's Dockerfile pip-installs uv into it, so the marker is removed (the bento's packages
go into BentoML's own /app/.venv).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from policy_bundle.build.containerize.run import require_tool, run_step
from policy_bundle.build.progress import log

BASE_IMAGE = "localhost/policy-bundle-base:bookworm"
SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates", "passwd")  # passwd: BentoML's useradd
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


PACKAGES_LABEL = "policy-bundle.packages"  # what the image was built with: another list rebuilds it


def built_with(podman: str, image: str) -> Optional[str]:
    """The package list ``image`` was built with ("" for an image without the label), None when it is absent."""
    res = subprocess.run([podman, "image", "inspect", "--format", f'{{{{index .Labels "{PACKAGES_LABEL}"}}}}', image],
                         capture_output=True, text=True)
    return res.stdout.strip().removeprefix("<no value>") if res.returncode == 0 else None


def mmdebstrap_command(rootfs: Path, ca_bundle: Path, packages: Sequence[str]) -> list:
    hooks = ['rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED']
    if ca_bundle.is_file():
        hooks.append(f'cp {ca_bundle} "$1"/etc/ssl/certs/ca-certificates.crt')
    return ["mmdebstrap", "--variant=minbase", f"--include={','.join(packages)}",
            *[f"--customize-hook={h}" for h in hooks], SUITE, str(rootfs)]


def ensure_base_image(podman: str, image: str = BASE_IMAGE, rebuild: bool = False, extra: Sequence[str] = (),
                      ca_bundle: Path = HOST_CA_BUNDLE) -> bool:
    """Build ``image`` with ``PACKAGES`` and ``extra`` (the bentofile's system packages) unless it exists with
    that list (or ``rebuild``); True when it was built now."""
    packages = list(dict.fromkeys([*PACKAGES, *extra]))
    found = built_with(podman, image)
    if not rebuild and found == ",".join(packages):
        log(f"base image: reusing {image}")
        return False
    if found is not None and not rebuild:
        log(f"base image: {image} was built with [{found}], not [{','.join(packages)}]: rebuilding")
    require_tool("mmdebstrap", "mmdebstrap", "builds the base image from Debian's packages")
    with tempfile.TemporaryDirectory(prefix="policy-bundle-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        log(f"base image: mmdebstrap {SUITE} with {', '.join(packages)} (about a minute)")
        run_step(mmdebstrap_command(rootfs, ca_bundle, packages), "mmdebstrap", echo=False)
        changes = ["ENV LANG=C.UTF-8", f"LABEL {PACKAGES_LABEL}={','.join(packages)}"]
        if ca_bundle.is_file():
            changes += [f"ENV SSL_CERT_FILE={HOST_CA_BUNDLE}", f"ENV PIP_CERT={HOST_CA_BUNDLE}"]
        run_step([podman, "import", *[a for c in changes for a in ("--change", c)], str(rootfs), image],
                 "podman import", echo=False)
    log(f"base image: built {image}")
    return True
