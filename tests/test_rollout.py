"""Rollout state machine and the incremental detokenizer, in process (the HTTP behaviour is in test_serve*)."""

import pytest

from policy_bundle.quantize.fidelity import GateThresholds
from policy_bundle.serve.rollout import RolloutConfig, RolloutController, RolloutStore, Window, analyse


class FailingStore(RolloutStore):
    """An injected fault: the SQLite save fails (disk full, locked database)."""

    fail = False

    def save(self, state, event=None):
        if self.fail:
            raise OSError("injected: database is locked")
        super().save(state, event)


def test_a_failed_save_changes_nothing_in_memory(tmp_path):
    store = FailingStore(tmp_path)
    ctl = RolloutController(store, RolloutConfig())
    before = (ctl.state.weight, ctl.state.status, ctl.state.step_index)
    store.fail = True
    for action in ("promote", "pause", "rollback"):
        with pytest.raises(OSError):
            ctl.command(action)
        assert (ctl.state.weight, ctl.state.status, ctl.state.step_index) == before
    with pytest.raises(OSError):
        ctl.apply("fail", ["x"], {})
    assert ctl.state.consecutive_failures == 0
    store.fail = False
    assert store.load().weight == ctl.state.weight


def test_history_pages_from_the_newest(tmp_path):
    store = RolloutStore(tmp_path)
    ctl = RolloutController(store, RolloutConfig())
    for i in range(30):
        ctl.note("n", f"event {i}", {})
    assert [e.reason for e in store.history(3)] == ["event 27", "event 28", "event 29"]
    assert store.count() == 31


def test_an_operator_weight_keeps_automatic_rollback(tmp_path):
    ctl = RolloutController(RolloutStore(tmp_path), RolloutConfig(failure_limit=2))
    assert ctl.command("set-weight", 40.0).status == "held"
    ctl.apply("pass", [], {})
    assert (ctl.state.weight, ctl.state.status) == (40.0, "held")  # passing never promotes a held weight
    ctl.apply("fail", ["bad"], {})
    ctl.apply("fail", ["bad"], {})
    assert (ctl.state.weight, ctl.state.status) == (0.0, "rolled-back")


def test_golden_runs_are_judged_with_the_bundle_thresholds():
    w = Window(golden={"items": 16, "greedy_agreement": 0.6, "reward_delta": 0.0})
    strict, lenient = GateThresholds(min_greedy_agreement=0.9), GateThresholds(min_greedy_agreement=0.5)
    assert analyse(w, RolloutConfig(min_samples=1), strict)[0] == "fail"
    assert analyse(w, RolloutConfig(min_samples=1), lenient)[0] == "pass"
    assert analyse(w, RolloutConfig(min_samples=1, thresholds=strict), lenient)[0] == "fail"  # config overrides


def byte_level_tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    core = ByteLevelBPETokenizer()
    core.train_from_iterator(["plain ascii words and spaces", "more words"] * 20, vocab_size=300, min_frequency=1)
    return PreTrainedTokenizerFast(tokenizer_object=core._tokenizer)


@pytest.mark.parametrize("stop", [[], ["caf"], ["é"], ["🙂 ok"]])
def test_text_stream_equals_one_decode_for_split_utf8(stop):
    from policy_bundle.bundle.info import decode
    from policy_bundle.serve.openai_api import TextStream

    tok = byte_level_tokenizer()
    text = "naïve café 日本語 🙂 ok and plain words"
    ids = tok(text)["input_ids"]
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)  # pieces split characters
    stream = TextStream(tok, stop)
    pieces = []
    for i in ids:
        pieces.append(stream.push(i))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    whole = decode(tok, ids)
    expected = whole[:min([whole.find(s) for s in stop if s in whole] or [len(whole)])]
    assert "".join(pieces) == expected and all("\ufffd" not in p for p in pieces)
