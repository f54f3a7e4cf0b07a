"""OpenAI-compatible formats: one adapter per endpoint (request -> token ids, result -> body or SSE chunks), the
server-sent-events loop of a streamed answer (``sse_events``), and the incremental detokenizer both the streamed and
the plain path use, so their texts are equal."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, List, Optional

from jinja2 import TemplateError

from policy_bundle.bundle.info import BundleInfo, ContentNotFound, control_token_texts, encode_chat, encode_text
from policy_bundle.quantize.runtime.text import ids_to_text
from policy_bundle.serve import serving_faults
from policy_bundle.serve.router.pool import interleaved
from policy_bundle.serve.schemas import ApiError, ChatRequest, CompletionRequest


class TextStream:
    """Token ids in, text out, as it becomes final. Each token is decoded incrementally with ``tokenizers``'
    ``DecodeStream`` (byte-level and SentencePiece tokenizers only make sense of tokens together: it holds back an
    incomplete UTF-8 character and decodes with the tokens before), so a token costs the same at the 2000th as at the
    first; a tokenizer without a fast backend decodes the whole sequence each time. Text that could start a stop
    string is held back (stop strings are looked for in the new text and a stop string's length before it), and a
    stop string ends it. ``finish`` decodes the whole sequence once: the streamed text adds up to exactly the plain
    one (``ids_to_text``), a trailing incomplete character included."""

    def __init__(self, tok, stop: List[str]):
        self.tok, self.stop = tok, stop
        self.ids: List[int] = []
        self.text, self.sent = "", 0
        self.stopped = False
        self.decoded = ""  # every complete character decoded so far
        self._longest_stop = max((len(x) for x in stop), default=0)
        backend = getattr(tok, "backend_tokenizer", None)
        self._stream = _decode_stream() if backend is not None else None
        self._backend = backend

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self._stream is None:
            return self._advance(ids_to_text(self.tok, self.ids), final=False, searched=0)
        before = len(self.decoded)
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - an id the stream cannot take (out of range): decode whole from here on
            self._stream = None
            return self._advance(ids_to_text(self.tok, self.ids), final=False, searched=0)
        self.decoded += piece or ""
        return self._advance(self.decoded, final=False, searched=max(0, before - self._longest_stop))

    def finish(self) -> str:
        return "" if self.stopped else self._advance(ids_to_text(self.tok, self.ids), final=True, searched=0)

    def _advance(self, text: str, final: bool, searched: int) -> str:
        """Send what of ``text`` is final; stop strings are looked for from ``searched`` on (before it: none)."""
        cut = min((i for i in (text.find(s, searched) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, final, self.stopped = text[:cut], True, True
        end = len(text)
        if not final:
            end = len(text.rstrip("\ufffd"))
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k], 0, end)), default=0)
            end -= hold
        end = max(end, self.sent)
        out, self.sent, self.text = text[self.sent:end], end, text[:end]
        return out


def _decode_stream():
    from tokenizers.decoders import DecodeStream

    return DecodeStream(skip_special_tokens=True)


@dataclass
class Prepared:
    """A validated request: what the variants need and what the response needs."""

    req: object
    prompt_ids: List[int]
    prompt_text: str
    max_tokens: int
    stop: List[str]
    rid: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    def stop_id(self, eos: Optional[int]) -> Optional[int]:
        """The token that ends generation: the tokenizer's EOS, or none with ``ignore_eos``."""
        return None if self.req.ignore_eos else eos

    def sampling(self, eos: Optional[int]) -> List[dict]:
        """One call's arguments per choice; with a seed, choice i samples with seed + i (the request stays
        reproducible and its choices differ)."""
        r = self.req
        base = dict(prompt_ids=self.prompt_ids, max_tokens=self.max_tokens, temperature=r.temperature,
                    top_p=r.top_p, stop_token_id=self.stop_id(eos), **r.sampling_modifiers(r.top_logprobs_wanted()))
        return [{**base, "seed": None if r.seed is None else (r.seed + i) % 2**63} for i in range(r.n)]

    def usage(self, n_tokens: int) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": n_tokens,
                "total_tokens": len(self.prompt_ids) + n_tokens}


def finish_reason(stream: TextStream, n_tokens: int, max_tokens: int, eos: Optional[int]) -> str:
    if stream.stopped or (stream.ids and stream.ids[-1] == eos):
        return "stop"
    return "length" if n_tokens >= max_tokens else "stop"


class Adapter:
    """What both endpoints share: limits, ids, the stop strings; subclasses shape bodies and chunks."""

    endpoint, schema, field_name, id_prefix = "", CompletionRequest, "prompt", "cmpl"

    def __init__(self, tok, info: BundleInfo, model_name: str):
        self.tok, self.info, self.model_name = tok, info, model_name

    def prepare(self, req) -> Prepared:
        text, ids = self.encode(req)
        max_tokens, context = self.max_tokens(req), self.info.max_seq_len
        asked = self.asked_tokens(req)
        if asked is not None and len(ids) < context and len(ids) + asked > context:
            name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise ApiError(400, f"{name}: {asked} exceeds the {context - len(ids)} tokens the context ({context}) "
                           f"leaves after the {len(ids)}-token prompt", name, asked, context - len(ids))
        if len(ids) + max_tokens > context:
            raise ApiError(400, f"{self.field_name}: {len(ids)} prompt tokens + max_tokens {max_tokens} exceed the "
                           f"context ({context})", self.field_name, len(ids) + max_tokens, context)
        return Prepared(req, ids, text, max_tokens, req.stop_strings(), f"{self.id_prefix}-{uuid.uuid4().hex[:24]}")

    def max_tokens(self, req) -> int:
        return req.max_tokens or self.info.max_new_tokens

    def asked_tokens(self, req) -> Optional[int]:
        """The new tokens the request itself asked for (None: the bundle's default)."""
        return req.max_tokens

    def text_stream(self, p: Prepared) -> TextStream:
        return TextStream(self.tok, p.stop)

    def _base(self, p: Prepared, variant: str) -> dict:
        return {"id": p.rid, "created": p.created, "model": self.model_name, "policy_variant": variant}

    def _chunk_base(self, p: Prepared, variant: str) -> dict:
        """A stream chunk's common fields; with ``stream_options.include_usage`` every chunk has ``usage: null``."""
        return {**self._base(p, variant), **({"usage": None} if p.include_usage else {})}

    def closing(self, p: Prepared, variant: str, stream: TextStream, n_tokens: int, eos: Optional[int],
                index: int = 0, logprobs: Optional[dict] = None) -> dict:
        """A choice's last chunk: its finish reason (and the logprobs of tokens that added no text)."""
        return self.chunk(p, variant, "", finish_reason(stream, n_tokens, p.max_tokens, p.stop_id(eos)), index,
                          logprobs)

    def wants_logprobs(self, p: Prepared) -> bool:
        return p.req.logprobs is not None and p.req.logprobs is not False

    def logprobs_of(self, p: Prepared, ids: List[int], logprobs: List[float], tops: List[list]) -> Optional[dict]:
        """The endpoint's ``logprobs`` for these tokens (None when not asked): in a plain answer all of them, in a
        streamed chunk those the chunk's text came from."""
        if not self.wants_logprobs(p):
            return None
        tokens = [ids_to_text(self.tok, [t]) for t in ids]
        top = [[(ids_to_text(self.tok, [t]), lp) for t, lp in alts] for alts in tops]
        return self.format_logprobs(p, tokens, logprobs, top)

    def step_logprobs(self, p: Prepared, steps: List[dict]) -> Optional[dict]:
        """``logprobs_of`` the variant's stream steps (``token_id``, ``logprob``, ``top``)."""
        if not steps:
            return None
        return self.logprobs_of(p, [s["token_id"] for s in steps], [s["logprob"] for s in steps],
                                [s.get("top") or [] for s in steps] if p.req.top_logprobs_wanted() else [])

    def usage_chunk(self, p: Prepared, variant: str, n_tokens: int) -> dict:
        """With ``include_usage``, the chunk before [DONE] the OpenAI spec describes: empty ``choices``, the whole
        request's ``usage`` (every choice's tokens)."""
        return {**self._base(p, variant), "object": self.chunk(p, variant, "")["object"], "choices": [],
                "usage": p.usage(n_tokens)}

    def complete(self, p: Prepared, variant: str, results: List[dict]) -> dict:
        """The non-streamed body: a choice per result; ``usage`` counts every choice's tokens."""
        choices = [self._choice(p, result, i) for i, result in enumerate(results)]
        usage = p.usage(sum(n for _, n in choices))
        return {**self._base(p, variant), "usage": usage, "choices": [c for c, _ in choices]}

    def _choice(self, p: Prepared, result: dict, index: int) -> tuple:
        """One choice and its token count: one decode of all ids (what a stream's pieces add up to), or, with stop
        strings, the same TextStream a stream uses, which ends at the first one."""
        stream = self.text_stream(p)
        if p.stop:
            for t in result["token_ids"]:
                stream.push(t)
                if stream.stopped:
                    break
            stream.finish()
        else:
            stream.ids, stream.text = list(result["token_ids"]), ids_to_text(self.tok, result["token_ids"])
        n = len(stream.ids)
        finish = finish_reason(stream, n, p.max_tokens, p.stop_id(self.tok.eos_token_id))
        lp = self.logprobs_of(p, stream.ids, result["logprobs"][:n], result.get("top_logprobs", [])[:n])
        return self.choice(p, stream.text, finish, lp, index), n


class CompletionsAdapter(Adapter):
    endpoint, schema, field_name, id_prefix = "completions", CompletionRequest, "prompt", "cmpl"

    def encode(self, req: CompletionRequest):
        if isinstance(req.prompt, list) and len(req.prompt) != 1:
            raise ApiError(400, "prompt: exactly one prompt per request", "prompt", len(req.prompt), 1)
        if req.echo and req.logprobs is not None:
            raise ApiError(400, "echo: prompt logprobs are not computed; use echo or logprobs, not both", "echo")
        text = req.prompt[0] if isinstance(req.prompt, list) else req.prompt
        if not text.strip():
            raise ApiError(400, "prompt: must not be empty", "prompt", text)
        return text, encode_text(self.tok, text)

    def complete(self, p: Prepared, variant: str, results: List[dict]) -> dict:
        return {**super().complete(p, variant, results), "object": "text_completion"}

    def format_logprobs(self, p: Prepared, tokens: List[str], logprobs: List[float], top: List[list]) -> dict:
        # top_logprobs: per token, the ``logprobs`` likeliest tokens' text -> logprob
        return {"tokens": tokens, "token_logprobs": logprobs, "text_offset": None,
                "top_logprobs": [dict(alts) for alts in top] if p.req.logprobs else None}

    def choice(self, p: Prepared, text: str, finish: str, lp: Optional[dict], index: int = 0) -> dict:
        return {"index": index, "text": (p.prompt_text if p.req.echo else "") + text, "finish_reason": finish,
                "logprobs": lp}

    def chunk(self, p: Prepared, variant: str, text: str, finish: Optional[str] = None, index: int = 0,
              logprobs: Optional[dict] = None) -> dict:
        return {**self._chunk_base(p, variant), "object": "text_completion",
                "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}]}

    def opening(self, p: Prepared, variant: str, index: int = 0) -> List[dict]:
        return [self.chunk(p, variant, p.prompt_text, index=index)] if p.req.echo else []


LINES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% if not loop.last %}\n{% endif %}{% endfor %}"


class ChatAdapter(Adapter):
    endpoint, schema, field_name, id_prefix = "chat", ChatRequest, "messages", "chatcmpl"

    def __init__(self, tok, info: BundleInfo, model_name: str, control_tokens: bool = False):
        super().__init__(tok, info, model_name)
        self.control_tokens = control_tokens  # the setting chat_control_tokens: typed control tokens are tokens
        tok.chat_template = serving_faults.chat_template(getattr(tok, "chat_template", None), LINES_TEMPLATE)

    def encode(self, req: ChatRequest):
        for i, m in enumerate(req.messages):
            if not m.content.strip():
                raise ApiError(400, f"messages.{i}.content: must not be empty", f"messages.{i}.content", m.content)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            return "", encode_chat(self.tok, messages, control_tokens=self.control_tokens)
        except ContentNotFound as exc:
            raise ApiError(400, f"{exc}: holds a control token's text (such as {control_token_texts(self.tok)[0]!r}) "
                           "and the chat template rewrites this content, so it cannot be kept as text",
                           str(exc)) from None
        except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
            # a template's raise_exception (roles out of order, a role it has no turn for) refuses these messages
            raise ApiError(400, f"messages: the model's chat template refused them ({type(exc).__name__}: "
                           f"{str(exc)[:200]})", "messages", code="invalid_request_error") from None

    def max_tokens(self, req: ChatRequest) -> int:
        return req.max_completion_tokens or super().max_tokens(req)

    def asked_tokens(self, req: ChatRequest) -> Optional[int]:
        return req.max_completion_tokens or req.max_tokens

    def complete(self, p: Prepared, variant: str, results: List[dict]) -> dict:
        return {**super().complete(p, variant, results), "object": "chat.completion"}

    def format_logprobs(self, p: Prepared, tokens: List[str], logprobs: List[float], top: List[list]) -> dict:
        alts = top or [[] for _ in tokens]
        return {"content": [{"token": t, "logprob": x, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": a, "logprob": y, "bytes": list(a.encode())} for a, y in alt]}
                            for t, x, alt in zip(tokens, logprobs, alts)]}

    def choice(self, p: Prepared, text: str, finish: str, lp: Optional[dict], index: int = 0) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": lp}

    def chunk(self, p: Prepared, variant: str, text: str, finish: Optional[str] = None, index: int = 0,
              logprobs: Optional[dict] = None, role: bool = False) -> dict:
        delta = {"role": "assistant", "content": text} if role else ({"content": text} if finish is None else {})
        return {**self._chunk_base(p, variant), "object": "chat.completion.chunk",
                "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

    def opening(self, p: Prepared, variant: str, index: int = 0) -> List[dict]:
        return [self.chunk(p, variant, "", index=index, role=True)]


# ---- the stream loop ---------------------------------------------------------------------------------------------


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


@dataclass
class StreamTally:
    """What a streamed answer came to, for whoever records it: tokens sent and whether it ended with ``[DONE]`` (a
    failure that cut it short goes to ``sse_events``' ``on_error``)."""
    tokens: int = 0
    done: bool = False


NextStep = Callable[[], Awaitable[Optional[dict]]]


async def sse_events(adapter: Adapter, p: Prepared, served: str, opened: list, next_steps: List[NextStep],
                     eos: Optional[int], tally: StreamTally, token_gap: Callable[[float], None] = lambda _: None,
                     on_error: Callable[[BaseException], None] = lambda _: None) -> AsyncIterator[str]:
    """The SSE events of a streamed answer: each choice's opening chunks, then its text chunks interleaved with the
    other choices' as their tokens come (``opened``: each choice's first step, already in hand; ``next_steps``: how
    to await its next one, None at its end), the usage chunk if asked and ``[DONE]``. A failure once tokens were
    sent ends it with an error event, after ``on_error`` has recorded it."""
    parts = [_choice_chunks(adapter, p, served, i, first, next_steps[i], eos, token_gap)
             for i, (first, _) in enumerate(opened)]
    try:
        for i in range(len(opened)):
            for chunk in adapter.opening(p, served, i):
                yield sse(chunk)
        async with contextlib.aclosing(parts[0] if len(parts) == 1 else interleaved(parts)) as chunks:
            async for chunk, tokens in chunks:
                tally.tokens += tokens
                if chunk is not None:
                    yield sse(chunk)
        if p.include_usage:
            yield sse(adapter.usage_chunk(p, served, tally.tokens))
        yield "data: [DONE]\n\n"
        tally.done = True
    except Exception as exc:  # noqa: BLE001 - tokens were sent: the client gets an error event, not a "stop"
        on_error(exc)
        yield sse({"error": {"message": f"variant {served} failed mid-stream ({type(exc).__name__})",
                             "type": "server_error", "code": "variant_failed", "param": None}})


async def _choice_chunks(adapter: Adapter, p: Prepared, served: str, index: int, first: Optional[dict],
                         next_step: NextStep, eos: Optional[int], token_gap: Callable[[float], None]):
    """One choice's chunks, each with the tokens it adds (a chunk is None while text is held back); asked for, a
    chunk carries the logprobs of the tokens its text came from (held-back tokens with the text that frees them,
    tokens that add no text with the last chunk), so they add up to the plain answer's."""
    text, n, step, unsent = adapter.text_stream(p), 0, first, []
    wanted, last = adapter.wants_logprobs(p), time.perf_counter()
    while step is not None:
        n += 1
        unsent += [step] if wanted else []
        delta = text.push(step["token_id"])
        if delta:
            yield adapter.chunk(p, served, delta, index=index, logprobs=adapter.step_logprobs(p, unsent)), 1
            unsent = []
        else:
            yield None, 1
        if text.stopped or n >= p.max_tokens:
            break
        step = await next_step()
        if step is not None:
            now = time.perf_counter()
            token_gap(now - last)
            last = now
    tail = text.finish()
    if tail:
        yield adapter.chunk(p, served, tail, index=index, logprobs=adapter.step_logprobs(p, unsent)), 0
        unsent = []
    yield adapter.closing(p, served, text, n, eos, index, adapter.step_logprobs(p, unsent)), 0
