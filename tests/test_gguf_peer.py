"""The llama.cpp peer's GGUFs (loadtest/gguf_peer.py): the fixture's tensors dequantized, written as Q8_0 with
the metadata and tokenizer copied; read back, every weight is within Q8_0's rounding of the FP32 weights."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # installed with transformers' GGUF support (the test extra)


def tensors(reader):
    """The dequantized tensors of the first and last blocks and those outside blocks (all, read back, is 10 s)."""
    last = f"blk.{reader.get_field('llama.block_count').contents() - 1}."
    return {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
            for t in reader.tensors if t.name.startswith(("blk.0.", last)) or not t.name.startswith("blk.")}


def test_a_q8_0_gguf_holds_the_fp32_weights_within_its_rounding_and_the_metadata(tmp_path):
    from policy_bundle.loadtest.gguf_peer import write_gguf
    from policy_bundle.loadtest.real_lm import gguf_path

    src = gguf.GGUFReader(str(gguf_path()))
    out = gguf.GGUFReader(str(write_gguf(gguf_path(), tmp_path / "q8.gguf", "Q8_0")))
    assert [(t.name, list(t.shape)) for t in out.tensors] == [(t.name, list(t.shape)) for t in src.tensors]
    fp32, q8 = tensors(src), tensors(out)
    kinds = {t.name: t.tensor_type for t in out.tensors}
    for name, w in fp32.items():
        if len([t for t in src.tensors if t.name == name][0].shape) == 1:  # norms stay F32, exact
            assert kinds[name] == gguf.GGMLQuantizationType.F32 and np.array_equal(q8[name], w)
            continue
        assert kinds[name] == gguf.GGMLQuantizationType.Q8_0
        # Q8_0: per 32 weights one fp16 scale d = max|w| / 127 and w / d rounded to int8; rounding d to fp16 can
        # put max|w| / d at 127.06, clamped to 127: an error up to 0.56 d (measured 0.551 on SmolLM2's weights)
        blocks = w.reshape(-1, 32)
        err = np.abs(q8[name].reshape(-1, 32) - blocks).max(axis=1)
        assert (err <= np.abs(blocks).max(axis=1) / 127 * 0.56 + 1e-7).all(), name
    assert out.get_field("general.file_type").contents() == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template", "llama.block_count"):
        assert out.get_field(key).contents() == src.get_field(key).contents(), key


def test_only_f32_and_q8_0_are_written(tmp_path):
    from policy_bundle.loadtest.gguf_peer import write_gguf
    from policy_bundle.loadtest.real_lm import gguf_path

    with pytest.raises(ValueError, match="qtype 'Q4_0'"):
        write_gguf(gguf_path(), tmp_path / "q4.gguf", "Q4_0")
    assert not (tmp_path / "q4.gguf").exists()
