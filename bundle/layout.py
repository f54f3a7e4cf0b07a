"""Every artifact path of a bundle, named once: the relative names (as the manifest records them) and
``BundleLayout(root)``, the same names as paths under one bundle directory.

A model-store entry has the same layout (a subset: its artifact directories beside the manifest and the
golden set), and a rejected build's report directory (``<out>.gate-rejected/``) holds the gate
report under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

INT8_DIR = "int8"  # the INT8 TorchScript (and ONNX) with the policy's HF config and tokenizer
INT8_TORCHSCRIPT = f"{INT8_DIR}/policy.ts"
INT8_ONNX = f"{INT8_DIR}/policy-int8.onnx"  # onnx may write external data beside it (same name, a suffix)
INT8_VLLM_DIR = "int8-vllm"  # the compressed-tensors W8A8 HF directory vLLM serves
FP16_DIR = "fp16"  # the float16 HF directory
ARTIFACT_DIRS = (INT8_DIR, INT8_VLLM_DIR, FP16_DIR)
GOLDEN = "golden.jsonl"  # the held-out golden set the gate judged
MANIFEST = "bundle.json"
SIGNATURE = "bundle.json.sig"  # the manifest's Ed25519 signature (bundle/signing.py); outside the file table
DRIFT_REPORT = "drift_report.json"  # only in a bundle the drift monitor rebuilt
GATE_REPORT = "gate_report.md"
GATE_REPORT_JSON = "gate_report.json"
SENSITIVITY_PLOT = "sensitivity.png"
KL_PLOT = "kl_distribution.png"


@dataclass(frozen=True)
class BundleLayout:
    """The paths of one bundle (or store entry) at ``root``."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def int8_dir(self) -> Path:
        return self.root / INT8_DIR

    @property
    def int8_torchscript(self) -> Path:
        return self.root / INT8_TORCHSCRIPT

    @property
    def int8_onnx(self) -> Path:
        return self.root / INT8_ONNX

    @property
    def int8_vllm_dir(self) -> Path:
        return self.root / INT8_VLLM_DIR

    @property
    def fp16_dir(self) -> Path:
        return self.root / FP16_DIR

    @property
    def golden(self) -> Path:
        return self.root / GOLDEN

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST

    @property
    def drift_report(self) -> Path:
        return self.root / DRIFT_REPORT

    @property
    def gate_report(self) -> Path:
        return self.root / GATE_REPORT

    @property
    def gate_report_json(self) -> Path:
        return self.root / GATE_REPORT_JSON

    @property
    def sensitivity_plot(self) -> Path:
        return self.root / SENSITIVITY_PLOT

    @property
    def kl_plot(self) -> Path:
        return self.root / KL_PLOT
