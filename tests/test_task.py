"""The reference task: reward, disjoint splits, HF tokenizer round trip, trained policy accuracy."""

from policy_bundle.quantize.reference import task


def test_reward_is_exact_match_on_reversed_sum():
    assert task.reward("358+64=", "998") == 1.0  # 853 + 46 = 899
    assert task.reward("358+64=", " 998 ") == 1.0
    assert task.reward("358+64=", "899") == 0.0
    assert task.reward("garbage", "1") == 0.0


def test_golden_set_is_disjoint_from_rollout_prompts():
    golden = {g.prompt for g in task.golden_set(200)}
    assert not golden & set(task.rollout_prompts(512))


def test_tokenizer_round_trips_and_prepends_bos():
    tok = task.build_tokenizer()
    ids = tok("12+34=")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == "12+34="


def test_reference_policy_solves_held_out_task(reference_dir):
    from policy_bundle.quantize.model.hf_weights import load_policy
    from policy_bundle.quantize.reference.embedded import evaluate_accuracy
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(reference_dir))
    acc = evaluate_accuracy(load_policy(reference_dir), tok, task.golden_set(200))
    assert acc >= 0.95


def test_the_shipped_reference_policy_is_what_this_code_trains():
    """Changing the task or the training code without re-shipping (``python -m policy_bundle.quantize.reference.embedded
    --ship``) would make every machine train its own weights again: this fails first."""
    from policy_bundle.quantize.reference.embedded import SHIPPED, TrainConfig, ensure_reference_policy, shipped_policy

    assert shipped_policy(TrainConfig()) == SHIPPED
    said = []
    ensure_reference_policy(log=said.append)
    assert not any("training" in line for line in said)


def test_a_changed_training_config_is_not_served_the_shipped_weights():
    from policy_bundle.quantize.reference.embedded import TrainConfig, shipped_policy

    assert shipped_policy(TrainConfig(steps=999)) is None  # negative control: the key names the config
