"""The router <-> variant stream: what the variant writes, the router reads back whole, however the transport cuts it."""

import asyncio
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


def test_bytes_cut_inside_a_character_are_read_back_whole():
    line = json.dumps({"error": "caf\u00e9 \u2713"}, ensure_ascii=False) + "\n"
    data = line.encode()
    reader = wire.LineReader()
    got = [s for i in range(len(data)) for s in reader.feed(data[i:i + 1])] + list(reader.finish())
    assert got == [{"error": "caf\u00e9 \u2713"}]


def test_a_stream_cut_inside_its_last_line_is_a_cut_off_not_a_parse_error():
    reader = wire.LineReader()
    assert list(reader.feed(wire.step_line(1, -0.5) + '{"token_id": 2, "logp')) == [{"token_id": 1, "logprob": -0.5}]
    with pytest.raises(wire.CutOff, match="ended inside a line"):
        list(reader.finish())


class _Service:
    """A variant's BentoML client as the pool sees it: ``to_async.stream`` yields the chunks it was given."""

    def __init__(self, chunks):
        self.to_async, self.chunks, self.closed = self, chunks, False

    async def stream(self, **kwargs):
        try:
            for chunk in self.chunks:
                yield chunk
        finally:
            self.closed = True


def _pool_steps(chunks):
    from policy_bundle.serve.router.pool import StreamFailed, VariantPool

    pool = VariantPool.__new__(VariantPool)
    pool.services = {"int8": _Service(chunks)}

    async def run():
        got = []
        try:
            async for step in pool._steps("int8", {}):
                got.append(step)
        except StreamFailed as exc:
            return got, exc
        return got, None
    return asyncio.run(run()), pool.services["int8"]


def test_the_pool_reads_a_variant_stream_split_anywhere_and_closes_it():
    text = "".join(_stream())
    chunks = _cut(text, random.Random(7))
    (got, failed), service = _pool_steps(chunks)
    assert failed is None and len(got) == 300 and got[0] == {"token_id": 0, "logprob": 0.0, "top": [[0, 0.0], [1, -2.5]]}
    assert service.closed
    # cut off inside a line, and cut off after a whole line without the end marker: both a 502 "cut off"
    (got, failed), _ = _pool_steps([wire.step_line(1, -0.5), '{"token_id": 2'])
    assert got == [{"token_id": 1, "logprob": -0.5}] and failed.error_code == 502 and "cut off" in str(failed)
    (got, failed), _ = _pool_steps([wire.step_line(1, -0.5)])
    assert failed.error_code == 502 and "end marker" in str(failed)
    (got, failed), _ = _pool_steps([wire.error_line("kv budget", 429)])
    assert got == [] and failed.error_code == 429
