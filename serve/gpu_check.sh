#!/usr/bin/env bash
# GPU check: on a CUDA machine, install the real vLLM, build the reference bundle, and check that
# vLLM serving the bundle's FP16 directory gives the FP32 policy's greedy outputs (>= 95 % of the
# golden set). Prints one "ok:" or "FAIL:" line; exit status 0 on ok.
#   bash serve/gpu_check.sh            (needs a registry for pip; uses .venv-gpu/)
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
VENV=.venv-gpu
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
# The real vLLM picks its own CUDA torch; our project's pins are relaxed for this venv only.
"$VENV/bin/pip" install -q vllm
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/pip" install -q pyyaml tqdm safetensors tokenizers transformers onnx onnxruntime onnxscript bentoml torchmonarch==0.7.0 matplotlib httpx
export POLICY_BUNDLE_CACHE=${POLICY_BUNDLE_CACHE:-$PWD/.cache/policy-bundle}
"$VENV/bin/policy-bundle" build --config build/configs/reference.yaml --out bundles/gpu-check --force \
  --set calibration.procs=0 --set register.bentoml=false
"$VENV/bin/policy-bundle" check-fp16 bundles/gpu-check --engine vllm
