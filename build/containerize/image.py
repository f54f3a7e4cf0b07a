"""Build the image: the local base, ``bentoml build`` with the build-time bentofile, ``bentoml containerize``.

The image is tagged with the bento tag (BentoML's default, ``localhost/policy-bundle:<version>`` in podman)
and any extra ``tags``. The layers before ``COPY . ./`` (uv, the venv, the packages) depend only on the bento's
``env/python`` files, so a new bundle with the same requirements rebuilds only its last layers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple

import yaml

from policy_bundle.build.containerize.base_image import BASE_IMAGE, ensure_base_image
from policy_bundle.build.containerize.bentofile import container_bentofile, system_packages
from policy_bundle.build.containerize.run import require_tool, run_step
from policy_bundle.build.errors import ContainerizeError
from policy_bundle.build.progress import Stages, log

BENTOML = [sys.executable, "-m", "bentoml"]
PINNED_MTIME = 315532800  # 1980-01-01, the zip epoch (any fixed time does)
STAGING = "bento-build"  # in the build context (git-ignored; BentoML refuses hidden paths): the generated bentofile and the files it ships


@dataclass(frozen=True)
class ContainerizeOptions:
    context: Path  # the checkout: bentofile.yaml and the sources it includes
    bento: Optional[str] = None  # an existing bento tag; None: `bentoml build` one first
    tags: Tuple[str, ...] = ()
    base_image: str = BASE_IMAGE
    rebuild_base: bool = False
    torch_wheel: Optional[Path] = None
    network: str = "host"  # the network of the build's RUN steps (the package index is reached through the host)
    extra_opts: Tuple[str, ...] = field(default=())  # more `bentoml containerize --opt` values


@dataclass(frozen=True)
class BuiltImage:
    bento: str
    image: str
    size_bytes: int


def find_bento(tag: str) -> Optional[Tuple[str, Path]]:
    """The bento's full tag (``latest`` resolved) and directory in the store, or None when there is none."""
    import bentoml
    from bentoml.exceptions import BentoMLException

    try:
        bento = bentoml.get(tag)
    except (BentoMLException, ValueError):  # not in the store; not a tag
        return None
    return str(bento.tag), Path(bento.path)


def _models_in_store(bentofile: Path) -> None:
    """The bentofile's models must be in the store before `bentoml build` (else its error is a traceback)."""
    import bentoml
    from bentoml.exceptions import NotFound

    for tag in yaml.safe_load(bentofile.read_text()).get("models") or []:
        try:
            bentoml.models.get(tag)
        except NotFound:
            home = os.environ.get("BENTOML_HOME", "~/bentoml")
            raise ContainerizeError(f"models: {tag} is not in the BentoML store (BENTOML_HOME={home}); run "
                                    "`policy-bundle build` first, or pass --bento <tag>") from None


def build_bento(opts: ContainerizeOptions) -> str:
    source = opts.context / "bentofile.yaml"
    if not source.is_file():
        raise ContainerizeError(f"--context: {opts.context} has no bentofile.yaml (run from the checkout)")
    _models_in_store(source)
    staging = opts.context / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    try:
        bentofile = container_bentofile(source, staging, opts.base_image, opts.torch_wheel)
        out = run_step([*BENTOML, "build", "-f", str(bentofile), "--output", "tag", str(opts.context)],
                       "bentoml build", cwd=opts.context)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    tags = [line.removeprefix("__tag__:") for line in out if line.startswith("__tag__:")]
    if not tags:
        raise ContainerizeError("bentoml build: printed no bento tag")
    return tags[-1]


def pin_python_env_mtimes(bento: Path) -> None:
    """Give the bento's ``env/python`` tree one fixed mtime. Buildah's cache key for ``COPY ./env/python`` digests
    the files' tar headers, mtimes included, and every ``bentoml build`` writes them anew: with equal content and
    equal times, the next bento reuses the package layer instead of reinstalling torch and vLLM."""
    env_python = bento / "env" / "python"
    for path in [env_python, *env_python.rglob("*")]:
        os.utime(path, (PINNED_MTIME, PINNED_MTIME), follow_symlinks=False)


def image_size(podman: str, image: str) -> int:
    res = subprocess.run([podman, "image", "inspect", "--format", "{{.Size}}", image], capture_output=True, text=True)
    return int(res.stdout.strip() or 0)


def containerize(opts: ContainerizeOptions) -> BuiltImage:
    podman = require_tool("podman", "podman", "`bentoml containerize --backend podman` builds the image with it")
    stages = Stages(3)
    with stages.run("bentoml build" if opts.bento is None else "find the bento") as line:  # inputs first
        found = find_bento(opts.bento or build_bento(opts))
        if found is None:
            raise ContainerizeError(f"--bento: {opts.bento} is not in the BentoML store "
                                    f"(BENTOML_HOME={os.environ.get('BENTOML_HOME', '~/bentoml')})")
        bento, path = found  # `latest` resolved: the image gets the version's tag
        line.detail = bento
        pin_python_env_mtimes(path)
    with stages.run("base image") as line:
        extra = system_packages(opts.context / "bentofile.yaml")
        line.detail = "built" if ensure_base_image(podman, opts.base_image, opts.rebuild_base, extra) else "reused"
    with stages.run("bentoml containerize --backend podman") as line:
        cmd = [*BENTOML, "containerize", "--backend", "podman", "--opt", f"network={opts.network}", bento,
               "-t", bento, *[a for t in opts.tags for a in ("-t", t)],
               *[a for o in opts.extra_opts for a in ("--opt", o)]]
        run_step(cmd, "bentoml containerize", cwd=opts.context)
        image = f"localhost/{bento}"
        line.detail = image
    size = image_size(podman, image)
    log(f"image: {image} ({size / 1e9:.2f} GB)" + "".join(f", also {t}" for t in opts.tags))
    return BuiltImage(bento=bento, image=image, size_bytes=size)
