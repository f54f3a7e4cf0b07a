"""The fields a config leaves unset take the policy's defaults: a general LM gets golden items long and many
enough to judge, each calibration prompt once, and no ONNX file its per-token recipe cannot pass with."""

import pytest

from policy_bundle.build.artifacts.artifact_fidelity import gate_artifacts
from policy_bundle.build.calibrate.prompt_split import search_share, split_golden, split_prompts
from policy_bundle.build.config.build_config import ONNX_AUTO_OFF, ConfigError, load_config, resolve_defaults
from policy_bundle.build.config.defaults import GENERAL_PROMPTS, default_general_golden, read_prompts_file


def general_lm(tmp_path, *sets):
    """A config naming only an HF directory (not the task's reference policy) and ``sets``."""
    (tmp_path / "lm").mkdir(exist_ok=True)
    return load_config(None, (f"policy.source={tmp_path / 'lm'}", *sets))


def test_a_general_lm_gets_32_tokens_100_golden_items_and_each_of_145_other_prompts_once(tmp_path):
    cfg = resolve_defaults(general_lm(tmp_path))
    n = len(read_prompts_file(GENERAL_PROMPTS))
    assert n == 245 and cfg.prompts.max_new_tokens == 32 and cfg.calibration.golden == 100
    assert cfg.calibration.samples == 145  # within the 128-512 a real LM's calibration asks for
    split = split_prompts(cfg)
    assert len(split.golden) == 100 and len(set(split.calibration)) == len(split.calibration) == 145
    assert not set(split.golden) & set(split.calibration)
    assert len(set(read_prompts_file(GENERAL_PROMPTS))) == n  # no prompt twice: no item on both sides


def test_the_search_takes_at_most_20_of_a_prompts_files_golden_items_and_the_gate_the_rest(tmp_path):
    items = list(range(100))
    split = split_golden(items, search_share(resolve_defaults(general_lm(tmp_path))))
    assert split.search == list(range(1, 40, 2)) and split.gate == list(range(0, 40, 2)) + list(range(40, 100))
    # a task policy's gate gets its N items and the search N more (alternating), as before
    task = split_golden(items, search_share(resolve_defaults(load_config(None))))
    assert task.search == items[1::2] and task.gate == items[::2]
    assert split_golden(items[:7], 20).gate == [0, 2, 4, 6] and split_golden(items[:2], 20).search == [1]
    # a smaller file still gives half to golden (at least 2), a larger one keeps 40 for calibration, up to 100
    assert [default_general_golden(n) for n in (3, 10, 80, 120, 140, 1000)] == [2, 5, 40, 80, 100, 100]


def test_the_task_policy_keeps_its_defaults_and_set_fields_are_kept(tmp_path):
    task = resolve_defaults(load_config(None))
    assert (task.prompts.max_new_tokens, task.calibration.samples, task.calibration.golden) == (8, 256, 128)  # recorded
    cfg = resolve_defaults(general_lm(tmp_path, "prompts.max_new_tokens=12", "calibration.samples=100",
                                      "calibration.golden=10"))
    assert (cfg.prompts.max_new_tokens, cfg.calibration.samples, cfg.calibration.golden) == (12, 100, 10)
    assert resolve_defaults(cfg) == cfg  # idempotent: a manifest's resolved config resolves to itself


def test_a_batch_larger_than_the_resolved_samples_is_one_line(tmp_path):
    n = 145  # the shipped file's calibration prompts
    with pytest.raises(ConfigError, match=rf"calibration.batch_size: 160 exceeds calibration.samples \({n}\)"):
        resolve_defaults(general_lm(tmp_path, "calibration.batch_size=160"))


def test_onnx_is_left_out_with_its_reason_when_every_candidate_is_per_token(tmp_path):
    auto = general_lm(tmp_path, "recipe.scheme=auto")  # the default candidates: all w8a8 (int8 head first)
    assert not auto.onnx_export() and gate_artifacts(auto, {}, tmp_path) == ONNX_AUTO_OFF
    # a torch.ao candidate (which onnxruntime's static recipe matches), or export.onnx set, builds it
    assert general_lm(tmp_path, "recipe.scheme=auto", "recipe.auto_candidates=[static, w8a8]").onnx_export()
    assert general_lm(tmp_path, "recipe.scheme=static").onnx_export()
    forced = general_lm(tmp_path, "recipe.scheme=w8a8", "export.onnx=true")
    assert forced.onnx_export()
    off = general_lm(tmp_path, "recipe.scheme=static", "export.onnx=false")
    assert not off.onnx_export() and gate_artifacts(off, {}, tmp_path) == "export.onnx: false"


def test_int8_vllm_is_gated_on_40_items_of_a_general_lm_and_every_item_of_a_task(tmp_path):
    from policy_bundle.build.artifacts.int8_vllm import INT8_VLLM_ITEMS, vllm_items

    items = list(range(80))
    assert vllm_items(resolve_defaults(general_lm(tmp_path)), items) == items[:INT8_VLLM_ITEMS] == list(range(40))
    assert vllm_items(resolve_defaults(load_config(None)), items) == items  # a task's reward bound needs them all


def test_the_policy_kind_is_decided_once_and_carried_after_the_source_is_gone(tmp_path):
    """A directory derived from the reference policy (its reference.json) is a task policy: the resolved config says
    so, and keeps saying so when the directory is gone (a bundle re-gated after its source was deleted)."""
    import shutil

    from policy_bundle.build.config.build_config import config_from_dict, is_task_policy

    derived = tmp_path / "derived"
    derived.mkdir()
    (derived / "reference.json").write_text("{}")
    cfg = load_config(None, (f"policy.source={derived}",))
    resolved = resolve_defaults(cfg)
    assert resolved.policy.kind == "task" and resolved.prompts.max_new_tokens == 8
    assert resolve_defaults(general_lm(tmp_path)).policy.kind == "general"
    shutil.rmtree(derived)
    stored = config_from_dict(resolved.to_dict())  # as `policy-bundle gate` reads a bundle's manifest
    assert is_task_policy(stored)
    assert not is_task_policy(cfg)  # negative control: the unresolved config probes the (gone) source again
    with pytest.raises(ConfigError, match=r"^policy.kind: task is judged on the reference task's prompts"):
        load_config(None, ("policy.kind=task", f"prompts.file={GENERAL_PROMPTS}"))
