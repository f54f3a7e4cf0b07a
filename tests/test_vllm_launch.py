"""The one vLLM launcher: the environment every vLLM process gets, the availability check, the engine arguments."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import yaml

from cli_helpers import needs_vllm
from policy_bundle.quantize.runtime.vllm_launch import (VLLM_ENV_DEFAULTS, apply_vllm_env_defaults, engine_args,
                                                        serve_cli_args, vllm_available, vllm_env)

ROOT = Path(__file__).resolve().parents[1]


def test_server_environment_is_the_defaults_then_the_callers_variables():
    env = vllm_env(POLICY_BUNDLE_VERSION="v1", VLLM_CPU_KVCACHE_SPACE="4")
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "POLICY_BUNDLE_VERSION": "v1"}
    assert dict(VLLM_ENV_DEFAULTS) == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_defaults_in_this_process_leave_what_the_environment_already_sets(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("VLLM_CPU_SGL_KERNEL", raising=False)
    apply_vllm_env_defaults(VLLM_CPU_SGL_KERNEL="0")
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "8" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and os.environ["VLLM_CPU_SGL_KERNEL"] == "0"


def test_the_switch_turns_vllm_off_unless_the_caller_ignores_it(monkeypatch):
    installed = importlib.util.find_spec("vllm") is not None
    monkeypatch.setenv("POLICY_BUNDLE_DISABLE_VLLM", "1")
    assert vllm_available() is False and vllm_available(honour_switch=False) is installed
    monkeypatch.setenv("POLICY_BUNDLE_DISABLE_VLLM", "0")
    assert vllm_available() is installed


def test_every_engine_is_eager_with_seed_0_and_the_cli_flags_say_the_same():
    assert engine_args("/m", "float16", max_logprobs=20) == {"model": "/m", "dtype": "float16", "enforce_eager": True,
                                                             "seed": 0, "max_model_len": None, "max_logprobs": 20}
    assert serve_cli_args("/m", "float16", 256) == ["--model", "/m", "--dtype", "float16", "--enforce-eager",
                                                    "--seed", "0", "--max-model-len", "256"]
    assert "--max-model-len" not in serve_cli_args("/m", "float16")  # None: the model's own context


def test_the_bento_image_runs_vllm_with_the_same_defaults():
    env = yaml.safe_load((ROOT / "bentofile.yaml").read_text())["docker"]["env"]
    assert {k: str(env.get(k)) for k in VLLM_ENV_DEFAULTS} == dict(VLLM_ENV_DEFAULTS)


RSS_SCRIPT = """
import sys
def rss_mb():
    return next(int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
from policy_bundle.quantize.runtime.vllm_launch import offline_engine
from vllm import SamplingParams
with offline_engine(sys.argv[1], "float32") as llm:
    out = llm.generate([{"prompt_token_ids": [1, 6, 13, 11, 14]}], SamplingParams(temperature=0, max_tokens=6),
                       use_tqdm=False)[0].outputs[0].token_ids
    inside = rss_mb()
print("RSS", inside, rss_mb(), list(out))
"""


@needs_vllm
def test_an_offline_engine_in_this_process_gives_its_memory_back_at_the_end_of_its_block(reference_dir):
    """In the caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) the engine's weights and 1 GiB KV cache are
    held while it runs (the control: RSS inside the block) and handed back when the block ends, with nothing
    left to the garbage collector (RSS right after it, before any collection)."""
    res = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(reference_dir)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, **vllm_env()})
    assert res.returncode == 0, res.stderr[-3000:]
    inside, after, out = next(ln for ln in res.stdout.splitlines() if ln.startswith("RSS ")).split(" ", 3)[1:]
    assert out == "[4, 4, 2]"  # the reference policy's greedy answer to 3+8= (reversed digits, then EOS)
    assert int(inside) > 1000 and int(after) < int(inside) - 500, (inside, after)
