"""Long work reports itself: done / total, a rate and an ETA, counted even when no terminal shows a bar."""

import re

from policy_bundle.build import progress
from policy_bundle.build.pipeline import logged_local_samples
from policy_bundle.quantize.model.hf_weights import init_random_policy
from policy_bundle.quantize.model.policy import PolicyConfig

CFG = PolicyConfig("llama", vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   intermediate_size=64, max_seq_len=64)


def test_rollout_progress_counts_sequences_with_a_rate_and_an_eta_off_a_terminal(monkeypatch, capsys):
    # a throttle of 0 s: every finished sequence prints; stderr is no terminal here, so the tqdm bar is disabled (the
    # count once read the bar's, which stays 0 when disabled: "0/145" until the end)
    monkeypatch.setattr(progress.Throttled.__init__, "__defaults__", (0.0,))
    prompts = [[3, 14, 15, 9], [2, 7], [1, 8, 2], [5]]
    logged_local_samples(init_random_policy(CFG, 0), prompts, 3, None, "samples")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[samples] sequences done")]
    counts = [int(re.search(r"\((\d+)/4, ", ln).group(1)) for ln in lines]
    assert counts == [1, 2, 3, 4], lines
    assert all(re.search(r"ETA \d+s\)$", ln) for ln in lines[:-1]), lines  # an ETA while work is left
    assert re.search(r"\(4/4, [\d.]+/s\)$", lines[-1]), lines
