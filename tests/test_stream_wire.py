"""The router <-> variant stream: what the variant writes, the router reads back whole, however the transport cuts it."""

import json
import random

import pytest

from policy_bundle.serve import wire


def _stream():
    lines = [wire.step_line(i, -0.01 * i, [(i, -0.01 * i), (i + 1, -2.5)] if i % 3 == 0 else None) for i in range(300)]
    return lines + [wire.done_line()]


def _cut(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), 200))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("seed", range(5))
def test_lines_split_across_chunks_are_read_back_whole(seed):
    lines = _stream()
    chunks = _cut("".join(lines), random.Random(seed))
    reader = wire.LineReader()
    got = [step for chunk in chunks for step in reader.feed(chunk)] + list(reader.finish())
    assert got == [json.loads(line) for line in lines]
    assert got[-1] == {"done": True} and got[3]["top"] == [[3, -0.03], [4, -2.5]]
    # the negative control: reading each chunk as whole lines, as a chunk-per-line reader would, fails on these chunks
    with pytest.raises(json.JSONDecodeError):
        [json.loads(item) for chunk in chunks for item in filter(None, chunk.splitlines())]


def test_chunks_of_several_lines_and_bytes_are_read():
    reader = wire.LineReader()
    text = wire.step_line(1, -0.5) + wire.error_line("kv budget", 429)
    assert list(reader.feed(text.encode())) == [{"token_id": 1, "logprob": -0.5}, {"error": "kv budget", "status": 429}]
    assert list(reader.finish()) == []


def test_a_last_line_without_its_newline_is_read_at_the_end():
    reader = wire.LineReader()
    assert list(reader.feed(wire.done_line().rstrip("\n"))) == []
    assert list(reader.finish()) == [{"done": True}]
