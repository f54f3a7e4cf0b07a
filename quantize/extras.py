"""The optional parts of an install: each extra of ``pyproject.toml`` (``pip install 'policy-bundle[mesh]'``), the
modules it provides, and a check a caller runs before the work that needs them, so a missing extra is one line
naming the setting that asked for it and the command that installs it. ``setup.sh`` installs every extra."""

from __future__ import annotations

import importlib
from typing import Dict, List, Tuple

# extra -> the modules it provides (the import names, not the distributions')
EXTRAS: Dict[str, Tuple[str, ...]] = {
    "mesh": ("monarch",),  # torchmonarch: the calibration mesh (calibration.procs / hosts > 0)
    "onnx": ("onnx", "onnxruntime", "onnxscript"),  # the INT8 ONNX export (export.onnx)
    "torchtitan": ("torchtitan",),  # torchtitan checkpoints as a policy source
    "postgres": ("psycopg",),  # router replicas sharing their rollout state (state_url: postgresql+psycopg://)
}


class MissingExtra(ImportError):
    """What a setting asks for is in an extra that is not installed; the message is the whole story."""


def missing(extra: str) -> List[str]:
    """The modules of ``extra`` that cannot be imported here."""
    gone = []
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            gone.append(module)
    return gone


def installed(extra: str) -> bool:
    return not missing(extra)


def require(extra: str, asked_by: str, instead: str = "") -> None:
    """Raise ``MissingExtra`` naming ``asked_by`` (the setting and its value) when ``extra`` is not installed;
    ``instead``: the setting that does without it."""
    gone = missing(extra)
    if gone:
        alternative = f", or set {instead}" if instead else ""
        raise MissingExtra(f"{asked_by} needs the [{extra}] extra ({', '.join(gone)} cannot be imported): "
                           f"pip install 'policy-bundle[{extra}]'{alternative}")
