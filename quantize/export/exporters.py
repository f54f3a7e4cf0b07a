"""Exporters: INT8 TorchScript (prefill/decode with KV cache), INT8 ONNX, FP16 HF directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import List

import torch
from torch import Tensor, nn

from policy_bundle.quantize.model.blocks import widened_copy
from policy_bundle.quantize.model.hf_weights import save_hf_weights
from policy_bundle.quantize.model.policy import FullSequence, Policy, PolicyConfig
from policy_bundle.quantize.w8a8.linear import fuse_projections, mark_batchable, stabilize_float_linears

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


def copy_tokenizer_files(source_dir: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            shutil.copy(source_dir / name, out / name)


def script_int8(int8: nn.Module) -> torch.jit.ScriptModule:
    """The INT8 policy as it ships, scripted: its int8 q/k/v and gate/up projections are fused in place first (the
    same outputs, one activation quantization and one matmul per input), its float fallback linears made
    row-stable (``stabilize_float_linears``: a decode batch's rows as alone), and its all-int8 blocks marked to run a
    step's decode rows and prompt chunks together (``mark_batchable``). In place, not on a copy: a deep copy
    turns the int8 LM head's float rows, an alias of the tied embedding, into a second 113 MB tensor."""
    fuse_projections(int8)
    stabilize_float_linears(int8)
    mark_batchable(int8)
    # for inference: no parameter asks for gradients (a caller without no_grad paid autograd's bookkeeping on every
    # op: a SmolLM2-135M decode step 18 ms instead of 13), and the fused modules (new, so in training mode) in eval
    int8.eval().requires_grad_(False)
    return torch.jit.script(int8)


def export_torchscript(int8: nn.Module, out: Path) -> Path:
    """Script the INT8 policy (``script_int8``); the file exposes ``new_cache``, ``prefill``, ``next_logits``,
    ``decode``, ``decode_batch``, ``step_and_prefill`` and ``step_seqs``."""
    scripted = script_int8(int8)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(scripted, str(out))
    return out


def export_onnx_fp32(policy: Policy, out: Path, example: Tensor) -> Path:
    """Full-sequence forward (tokens [B, T] -> logits [B, T, V]) with dynamic batch and length."""
    batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("seq", min=2, max=policy.max_seq_len)
    torch.onnx.export(
        FullSequence(widened_copy(policy)).eval(),
        (example,),
        str(out),
        dynamo=True,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes={"tokens": {0: batch, 1: seq}},
        external_data=False,
        verbose=False,
    )
    return out


def _linear_matmuls(model_path: Path, keep_float: List[str]) -> tuple[List[str], List[str]]:
    """Split MatMul/Gemm nodes into those of quantizable linears (weight is an initializer) and the rest."""
    import onnx

    model = onnx.load(str(model_path))
    inits = {i.name for i in model.graph.initializer}
    quantize, exclude = [], []
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        is_linear = any(i in inits for i in node.input[1:2])
        floating = any(k in node.name or any(k in i for i in node.input) for k in keep_float)
        (quantize if is_linear and not floating else exclude).append(node.name)
    return quantize, exclude


def export_onnx_int8(policy: Policy, out_dir: Path, calib: List[Tensor], keep_float: List[str]) -> Path:
    """FP32 ONNX export quantized by onnxruntime's static quantization on the same calibration set."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"input_ids": b.numpy().astype("int64")} for b in calib])

        def get_next(self):
            return next(self.it, None)

    out_dir.mkdir(parents=True, exist_ok=True)
    fp32 = out_dir / "policy-fp32.tmp.onnx"
    pre = out_dir / "policy-pre.tmp.onnx"
    final = out_dir / "policy-int8.onnx"
    export_onnx_fp32(policy, fp32, calib[0][:1, : max(2, calib[0].shape[1])])
    try:
        quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
    except Exception:  # pre-processing is an optimisation; quantize the raw export instead
        shutil.copy(fp32, pre)
    nodes, excluded = _linear_matmuls(pre, keep_float)
    quantize_static(
        str(pre),
        str(final),
        Reader(),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
        nodes_to_quantize=nodes,
        nodes_to_exclude=excluded,
        extra_options={"ActivationSymmetric": False, "WeightSymmetric": True},
    )
    fp32.unlink(missing_ok=True)
    pre.unlink(missing_ok=True)
    for extra in out_dir.glob("*.tmp.onnx.data"):
        extra.unlink()
    return final


def export_fp16_hf(policy: Policy, cfg: PolicyConfig, source_dir: Path, out: Path) -> Path:
    """HF directory vLLM loads as is: float16 safetensors, config, tokenizer, generation_config."""
    save_hf_weights(policy, cfg, out, torch.float16)
    write_serving_files(cfg, source_dir, out)
    return out


def write_serving_files(cfg: PolicyConfig, source_dir: Path, out: Path) -> None:
    """What an HF directory needs beside its weights to be served: tokenizer files and generation_config."""
    copy_tokenizer_files(source_dir, out)
    gen_src = source_dir / "generation_config.json"
    gen = json.loads(gen_src.read_text()) if gen_src.is_file() else {}
    gen.setdefault("bos_token_id", cfg.bos_token_id)
    gen.setdefault("eos_token_id", cfg.eos_token_id)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
