"""The one decode loop: prefill, then one cached decode per yielded token, for eager and TorchScript alike."""

import torch

from policy_bundle.quantize.runtime.decode import decode_steps, decode_tokens_per_s, greedy_generate
from policy_bundle.quantize.model.policy import PolicyConfig, full_logits
from policy_bundle.quantize.model.hf_weights import init_random_policy

CFG = PolicyConfig("llama", vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   intermediate_size=64, max_seq_len=64)


class CountingPolicy(torch.nn.Module):
    """Counts the decode calls of the wrapped policy."""

    def __init__(self, policy):
        super().__init__()
        self.policy, self.decodes = policy, 0

    def new_cache(self, batch, total):
        return self.policy.new_cache(batch, total)

    def prefill(self, ids, k, v):
        return self.policy.prefill(ids, k, v)

    def decode(self, token, pos, k, v):
        self.decodes += 1
        return self.policy.decode(token, pos, k, v)


def test_greedy_tokens_are_the_argmax_of_the_teacher_forced_logits():
    policy = init_random_policy(CFG, 0)
    prompt = [3, 14, 15, 9]
    out = greedy_generate(policy, prompt, 10)
    logits = full_logits(policy, torch.tensor([prompt + out]))
    assert out == logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()


def test_stop_token_is_yielded_last_and_no_decode_runs_for_an_unyielded_token():
    policy = CountingPolicy(init_random_policy(CFG, 0))
    free = greedy_generate(policy.policy, [3, 14, 15, 9], 10)
    steps = list(decode_steps(policy, [3, 14, 15, 9], 10, stop_token_id=free[4]))
    first_stop = free.index(free[4])
    assert [s.token_id for s in steps] == free[: first_stop + 1] and policy.decodes == first_stop


def test_max_seq_len_caps_the_new_tokens():
    steps = list(decode_steps(init_random_policy(CFG, 0), [3, 14, 15, 9], 10, max_seq_len=7))
    assert len(steps) == 3 and all(s.logits.shape == (CFG.vocab_size,) for s in steps)


def test_torchscript_module_decodes_like_the_eager_policy():
    policy = init_random_policy(CFG, 1)
    assert greedy_generate(torch.jit.script(policy), [5, 6, 7], 12) == greedy_generate(policy, [5, 6, 7], 12)


def test_decode_speed_times_only_the_decode_steps():
    assert decode_tokens_per_s(init_random_policy(CFG, 0), [1] * 8, 4, repeats=1, warmup=0) > 0


def test_batched_greedy_generation_equals_one_sequence_at_a_time():
    """Prompts of different lengths, rows leaving at the stop token or the length limit, odd batch sizes."""
    from policy_bundle.quantize.runtime.decode import greedy_generate_batch

    policy = init_random_policy(CFG, 1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CFG.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 12, (37,), generator=g)]
    free = [greedy_generate(policy, p, 10) for p in prompts]
    eos = max(set(t for f in free for t in f[:5]), key=lambda t: sum(t in f[:5] for f in free))  # a common token
    alone = [greedy_generate(policy, p, 10, eos_token_id=eos) for p in prompts]
    assert any(len(a) < 10 for a in alone) and any(len(a) == 10 for a in alone)  # some rows do stop early
    finished = []
    assert greedy_generate_batch(policy, prompts, 10, eos, batch_size=8, done=finished.append) == alone
    assert sorted(finished) == list(range(len(prompts)))
    assert greedy_generate_batch(torch.jit.script(policy), prompts[:5], 10, eos, batch_size=3) == alone[:5]


def test_the_gate_decodes_golden_items_in_batches_only_where_rows_are_independent(monkeypatch):
    """The gate's greedy completions in decode batches (80 SmolLM2-135M items: 46 s, one at a time 124) give each
    item the tokens it gets alone; a recipe whose activations take one scale over the whole input (torch.ao
    ``dynamic``, anywhere) decodes one item at a time, as it is served."""
    import policy_bundle.quantize.fidelity.scores as fidelity
    from policy_bundle.build.gate.measure import decode_batch
    from policy_bundle.quantize.recipes import RecipeConfig

    assert decode_batch(RecipeConfig(scheme="smooth-w8a8")) == decode_batch(RecipeConfig(scheme="static")) > 1
    assert decode_batch(RecipeConfig(scheme="dynamic")) == 1
    assert decode_batch(RecipeConfig(scheme="static", overrides=(("down_proj", "dynamic"),))) == 1
    policy = init_random_policy(CFG, seed=3)
    items = [fidelity.GoldenItem(str(i), [1 + i, 7, 3 + 2 * i, 9][: 2 + i % 3], []) for i in range(7)]
    alone = fidelity.greedy_completions(policy, items, 6, 5)
    monkeypatch.setattr(fidelity, "greedy_generate", None)  # the batched path never decodes one item alone
    assert fidelity.greedy_completions(policy, items, 6, 5, batch=3) == alone


def test_the_gates_greedy_decodes_on_the_served_engines_thread_count_and_restores_the_callers():
    """A decode step's float rounding depends on torch's intra-op threads: the build's gate decodes with the served
    INT8 engine's default (``DECODE_THREADS``, serve's ``engine_threads``), not with the build's own."""
    from policy_bundle.quantize.runtime.decode import DECODE_THREADS
    from policy_bundle.quantize.fidelity.scores import GoldenItem, greedy_completions
    from policy_bundle.serve.settings import RouterSettings

    seen = []

    class Recording(CountingPolicy):
        def decode(self, token, pos, k, v):
            seen.append(torch.get_num_threads())
            return super().decode(token, pos, k, v)

    policy = Recording(init_random_policy(CFG, seed=0))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        items = [GoldenItem("p", [1, 2, 3], [4, 5]), GoldenItem("q", [3, 4], [5, 6])]
        assert greedy_completions(policy, items, 4, None) == [greedy_generate(policy, it.prompt_ids, 4) for it in items]
        assert seen[:6] == [DECODE_THREADS] * 6 and torch.get_num_threads() == 2  # the caller's count is back
    finally:
        torch.set_num_threads(before)
    assert RouterSettings().engine_threads == DECODE_THREADS
