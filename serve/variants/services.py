"""The two variant services: INT8 (TorchScript, or vLLM on the W8A8 dir: ``int8_engine``) and FP16 (vLLM,
or our policy module as fallback).

Each loads its artifact from the BentoML model store only after re-hashing it against the bundle
manifest; a mismatch stops the service from starting with one clear log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from contextlib import aclosing
from http import HTTPStatus
from pathlib import Path
from typing import AsyncGenerator, Dict, List, Optional, Sequence

import bentoml
from bentoml.exceptions import BentoMLException, InvalidArgument, NotFound

from policy_bundle.bundle.info import BundleInfo
from policy_bundle.bundle.layout import FP16_DIR, INT8_DIR, INT8_TORCHSCRIPT, INT8_VLLM_DIR, BundleLayout
from policy_bundle.bundle.model_store import pair_version
from policy_bundle.quantize.runtime.vllm_launch import vllm_available, vllm_switched_off
from policy_bundle.serve import logs, serving_faults, wire
from policy_bundle.serve.variants.batching import policy_engine
from policy_bundle.serve.variants.engines import CapacityError, SamplingParams, Step, VllmEngine
from policy_bundle.serve.http import TRAFFIC_TIMEOUT_S, patch_bentoml_timeout
from policy_bundle.serve.settings import settings_or_exit
from policy_bundle.serve.model_entries import manifest_sha, refuse, verified_artifact, verified_bytes, verified_copy

log = logging.getLogger("policy_bundle.serve")
logs.configure(settings_or_exit().log_format)
VERSION = pair_version(os.environ.get("POLICY_BUNDLE_VERSION", "latest"), log.warning)


def _vllm_missing() -> str:
    """Why vLLM is not used; switched off is read from the environment alone (importing vllm to word the
    message took 4 s of every fallback worker's start)."""
    return "switched off (POLICY_BUNDLE_DISABLE_VLLM)" if vllm_switched_off() else "not importable"


def _require_what_the_settings_need() -> None:
    """``require_vllm`` or ``int8_engine: vllm`` that cannot be met (vLLM switched off or missing, no int8-vllm/
    in the store entry): stop ``bentoml serve`` itself (this runs where the service graph is imported), one
    line, before any worker starts."""
    settings = settings_or_exit()
    if settings.trusted_keys:  # checked again by each service as it loads (verified_artifact)
        _require_signed_entries([Path(k) for k in settings.trusted_keys])
    if settings.require_vllm and not vllm_available(load=True):
        refuse(f"require_vllm: vLLM is {_vllm_missing()}")
    if settings.int8_engine != "vllm":
        return
    try:
        entry = bentoml.models.get(f"policy-int8:{VERSION}")
    except NotFound:
        return  # the service's own model reference reports it
    if not BundleLayout(entry.path).int8_vllm_dir.is_dir():
        refuse(f"int8_engine: vllm, but {entry.tag} has no {INT8_VLLM_DIR}/ (build the bundle with "
               "export.int8_vllm: true, or serve with int8_engine: torchscript)")
    if not vllm_available(load=True):
        refuse(f"int8_engine: vllm, but vLLM is {_vllm_missing()}")


def _require_signed_entries(trusted: List[Path]) -> None:
    """With trusted keys set, both store entries signed by one of them, or ``bentoml serve`` stops with one line
    (a refusal inside a worker would only have it restarted)."""
    from policy_bundle.bundle.manifest import BundleVerificationError
    from policy_bundle.bundle.signing import verify_signature

    for name in ("policy-int8", "policy-fp16"):
        try:
            entry = bentoml.models.get(f"{name}:{VERSION}")
        except NotFound:
            return  # the service's own model reference reports it
        try:
            verify_signature(Path(entry.path), trusted)
        except BundleVerificationError as exc:
            refuse(f"{entry.tag}: {exc}")


_require_what_the_settings_need()
patch_bentoml_timeout()  # every service here (the router imports this module too)


def int8_vllm_engine(path: Path, max_seq_len: int) -> VllmEngine:
    """vLLM on the entry's int8-vllm/ (verified with int8/, its sibling in the entry; its presence and vLLM
    were checked at import: ``_require_what_the_settings_need``)."""
    dtype = json.loads((path / "config.json").read_text()).get("torch_dtype", "float16")
    return VllmEngine(path, max_seq_len, dtype=dtype, name="vllm-w8a8",
                      first_token_s=batching_settings()["first_token_s"])


async def warm_up_engine(svc) -> None:
    """A real generation before the variant calls itself ready."""
    [s async for s in svc.engine.generate([1, 2, 3], SamplingParams(max_tokens=1))]
    svc.ready = True


def context_len(artifact: Path) -> int:
    """The bundle's context length, the same number the router checks prompts against."""
    return BundleInfo.read(artifact.parent).max_seq_len


def vocab_size(artifact: Path) -> int:
    return int(json.loads((artifact / "config.json").read_text())["vocab_size"])


def open_entry(variant, sub: str, read_verified: Sequence[str] = ()) -> Path:
    """A variant service's store entry, verified against its manifest: sets the variant's manifest sha256, context
    length and vocabulary size (what ``health`` and the input checks read); returns the artifact dir. The entry paths
    in ``read_verified`` are hashed as they are read (``engine_dir``'s private copy, ``verified_bytes``), not here too:
    the weights are read once."""
    path = verified_artifact(variant.model, sub, settings_or_exit().trusted_keys, read_verified)
    variant.manifest = manifest_sha(variant.model)
    variant.max_seq_len, variant.vocab_size = context_len(path), vocab_size(path)
    return path


def engine_dir(variant, root: Path, sub: str) -> Path:
    """The directory an engine that opens files by path loads ``sub/`` from: with trusted keys, a private copy of the
    verified bytes (``verified_copy``); else the verified entry itself."""
    variant.verified_copy = bool(settings_or_exit().trusted_keys)
    return verified_copy(root, sub) if variant.verified_copy else root / sub


def variant_health(variant, **extra) -> dict:
    """What the router's probe reads: ready, the engine and its state (a dead vLLM engine core is ``dead``), the
    batch with the age of its last decode step while work waits (a hung decode thread), the manifest."""
    state = variant.engine.state() if hasattr(variant.engine, "state") else "running"
    return {"ready": variant.ready, "engine": variant.engine.name, "engine_state": state,
            "max_seq_len": variant.max_seq_len, "test_fault": serving_faults.spec(), "batch": engine_stats(variant.engine),
            "manifest_sha256": variant.manifest, "verified_copy": getattr(variant, "verified_copy", False), **extra}


def batching_settings() -> dict:
    s = settings_or_exit()
    return {"max_batch": s.max_batch, "prefill_chunk": s.prefill_chunk, "threads": s.engine_threads,
            "lanes": s.engine_lanes, "kv_cache_bytes": s.kv_cache_bytes,
            # a wait the router would give up on first would count as the variant's failure: a 429 comes before it
            "kv_wait_s": min(s.kv_wait_s, 0.8 * s.request_timeout_s) if s.request_timeout_s else s.kv_wait_s,
            # the same for a first token that a busy engine has not produced yet (queued or prefilling behind others)
            "first_token_s": 0.8 * s.request_timeout_s if s.request_timeout_s else None}


def engine_stats(engine) -> Optional[dict]:
    """The engine's batch, queue and KV cache: the batched engine's slots, vLLM's scheduler (None for an engine that
    reports none)."""
    return engine.stats() if hasattr(engine, "stats") else None


def check_input(svc, ids: List[int], max_tokens: int = 0, temperature: float = 0.0, top_p: float = 1.0) -> None:
    """The variants' own APIs are HTTP endpoints too: a bad call is a 400 naming the limit, not a
    500 from deep inside the model."""
    if not ids:
        raise InvalidArgument("prompt_ids: must not be empty")
    bad = next((t for t in ids if not 0 <= t < svc.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"prompt_ids: token id {bad} is outside the vocabulary [0, {svc.vocab_size})")
    if len(ids) + max_tokens > svc.max_seq_len:
        raise InvalidArgument(f"prompt_ids: {len(ids)} tokens + max_tokens {max_tokens} exceed the context "
                              f"({svc.max_seq_len})")
    if max_tokens < 0 or not 0.0 <= temperature <= 2.0 or not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"max_tokens {max_tokens} must be >= 0, temperature {temperature} in [0, 2], "
                              f"top_p {top_p} in (0, 1]")


def served_engine(svc):
    """The engine as requests reach it: ``serve.serving_faults.with_faults`` of ``svc.engine``, made once per engine (the
    warm-up and health read ``svc.engine`` itself)."""
    if getattr(svc, "_served_for", None) is not svc.engine:
        svc._served, svc._served_for = serving_faults.with_faults(svc.variant, svc.engine), svc.engine
    return svc._served


async def _collect(engine, prompt_ids: List[int], params: SamplingParams, deadline_s: Optional[float] = None) -> dict:
    """The whole generation; with ``deadline_s``, given up after that many seconds, its decode stopped (the engine
    frees the slot at its next step): a caller gone for good (the router timed out or failed over) cannot keep a
    slot decoding up to ``max_tokens``, since a plain call's handler is not cancelled when its client leaves."""
    steps: List[Step] = []
    try:
        async with asyncio.timeout(deadline_s):
            async with aclosing(engine.generate(prompt_ids, params)) as gen:
                async for s in gen:
                    steps.append(s)
    except TimeoutError:
        raise TimeoutError(f"deadline_s: generation stopped after {deadline_s:g}s ({len(steps)} tokens)") from None
    out = {"token_ids": [s.token_id for s in steps], "logprobs": [s.logprob for s in steps]}
    if params.top_logprobs:
        out["top_logprobs"] = [[list(t) for t in s.top] for s in steps]
    return out


MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS = 300, 20  # OpenAI's limits


class TooManyRequests(BentoMLException):
    """A 429 from a variant's API (its engine's KV memory did not come free in time): the router passes it on."""

    error_code = HTTPStatus.TOO_MANY_REQUESTS


def as_http_error(exc: CapacityError) -> BentoMLException:
    return InvalidArgument(str(exc)) if exc.status == 400 else TooManyRequests(str(exc))


def _params(svc, max_tokens: int, temperature: float, top_p: float, seed: Optional[int], stop: Optional[int],
            logit_bias: Optional[Dict[int, float]] = None, presence_penalty: float = 0.0,
            frequency_penalty: float = 0.0, top_logprobs: int = 0) -> SamplingParams:
    """The request's sampling, its modifiers checked against this variant's vocabulary and OpenAI's ranges."""
    bias = dict(logit_bias or {})
    bad = next((t for t in bias if not 0 <= int(t) < svc.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"logit_bias: token id {bad} is outside the vocabulary [0, {svc.vocab_size})")
    if len(bias) > MAX_LOGIT_BIAS or any(not -100.0 <= float(v) <= 100.0 for v in bias.values()):
        raise InvalidArgument(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, each biased within [-100, 100]")
    if not (-2.0 <= presence_penalty <= 2.0 and -2.0 <= frequency_penalty <= 2.0):
        raise InvalidArgument("presence_penalty, frequency_penalty: each within [-2, 2]")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs: {top_logprobs} is out of range [0, {MAX_TOP_LOGPROBS}]")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop_token_id=stop,
                          logit_bias=tuple(sorted((int(t), float(v)) for t, v in bias.items())),
                          presence_penalty=float(presence_penalty), frequency_penalty=float(frequency_penalty),
                          top_logprobs=int(top_logprobs))


def generation_apis():
    """The ``generate`` and ``stream`` APIs both variants expose over their ``self.engine``."""

    @bentoml.api
    async def generate(self, prompt_ids: List[int], max_tokens: int = 16, temperature: float = 0.0,
                       top_p: float = 1.0, seed: Optional[int] = None, stop_token_id: Optional[int] = None,
                       deadline_s: Optional[float] = None, logit_bias: Optional[Dict[int, float]] = None,
                       presence_penalty: float = 0.0, frequency_penalty: float = 0.0, top_logprobs: int = 0,
                       request_id: Optional[str] = None) -> dict:
        logs.REQUEST_ID.set(logs.request_id(request_id))  # the router's id: this call's log lines carry it
        t0 = time.perf_counter()
        check_input(self, prompt_ids, max_tokens, temperature, top_p)
        if deadline_s is not None and not deadline_s > 0:
            raise InvalidArgument(f"deadline_s: {deadline_s} must be > 0 seconds")
        params = _params(self, max_tokens, temperature, top_p, seed, stop_token_id, logit_bias, presence_penalty,
                         frequency_penalty, top_logprobs)
        try:
            out = await _collect(served_engine(self), prompt_ids, params, deadline_s)
        except CapacityError as exc:
            raise as_http_error(exc) from None
        log.info("generated", extra={"variant": self.variant, "tokens": len(out["token_ids"]),
                                     "seconds": round(time.perf_counter() - t0, 4)})
        return out

    @bentoml.api
    async def stream(self, prompt_ids: List[int], max_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
                     seed: Optional[int] = None, stop_token_id: Optional[int] = None,
                     logit_bias: Optional[Dict[int, float]] = None, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, top_logprobs: int = 0,
                     request_id: Optional[str] = None) -> AsyncGenerator[str, None]:
        # A stream's status line is sent before its body runs, so every outcome is a line: steps, then
        # {"done": true}, or {"error", "status"}; a stream that ends without either was cut off.
        logs.REQUEST_ID.set(logs.request_id(request_id))
        t0, n = time.perf_counter(), 0
        try:
            check_input(self, prompt_ids, max_tokens, temperature, top_p)
            params = _params(self, max_tokens, temperature, top_p, seed, stop_token_id, logit_bias, presence_penalty,
                             frequency_penalty, top_logprobs)
        except InvalidArgument as exc:
            yield wire.error_line(str(exc), 400)
            return
        try:
            async with aclosing(served_engine(self).generate(prompt_ids, params)) as steps:
                async for s in steps:
                    n += 1
                    yield wire.step_line(s.token_id, s.logprob, s.top)
        except CapacityError as exc:  # a request this engine cannot take now (429) or ever (400)
            yield wire.error_line(str(exc)[:500], exc.status)
            return
        except Exception as exc:  # noqa: BLE001 - reported in-band: the caller must not take it for an end
            log.warning("%s stream failed: %s: %s", self.variant, type(exc).__name__, exc)
            yield wire.error_line(f"{type(exc).__name__}: {exc}"[:300], 500)
            return
        log.info("streamed", extra={"variant": self.variant, "tokens": n, "seconds": round(time.perf_counter() - t0, 4)})
        yield wire.done_line()

    return generate, stream


@bentoml.service(name="int8-policy", workers=1, traffic={"timeout": TRAFFIC_TIMEOUT_S})
class Int8Policy:
    variant = "int8"
    model = bentoml.models.BentoModel(f"policy-int8:{VERSION}")

    def __init__(self) -> None:
        from policy_bundle.quantize.runtime.script_runner import InexactInt8Error, load_torchscript

        vllm, copied = settings_or_exit().int8_engine == "vllm", bool(settings_or_exit().trusted_keys)
        # what is read through a hashing reader: the TorchScript always (``verified_bytes``), int8-vllm/ when
        # ``engine_dir`` copies it (trusted keys)
        path = open_entry(self, INT8_DIR, ([INT8_VLLM_DIR] if copied else []) if vllm else [INT8_TORCHSCRIPT])
        entry = BundleLayout(path.parent)
        if vllm:
            self.engine, self.ready = int8_vllm_engine(engine_dir(self, path.parent, INT8_VLLM_DIR),
                                                       self.max_seq_len), False
            log.info("INT8 W8A8 loaded in vLLM from %s (verified)", entry.int8_vllm_dir)
            return
        batching = batching_settings()
        if not BundleInfo.read(path.parent).batch_rows:  # per-tensor dynamic activations: rows see each other
            log.info("INT8 recipe quantizes activations per tensor at run time: one request per decode step")
            batching["max_batch"] = 1
        try:
            module = load_torchscript(entry.int8_torchscript, verified_bytes(path.parent, INT8_TORCHSCRIPT))
        except InexactInt8Error as exc:  # its int8 sums would saturate on this CPU: wrong answers, never served
            log.error("refusing to start: %s", exc)
            raise SystemExit(f"policy-bundle: {exc}"[:500]) from None
        self.engine = policy_engine(module, self.max_seq_len, "int8-torchscript", step_hooks=serving_faults.step_hook,
                                    **batching)
        self.engine.score([[1, 2, 3]])  # a real forward before we call ourselves ready
        self.ready = True
        log.info("INT8 TorchScript loaded from %s (verified)", path)

    @bentoml.on_startup
    async def warm_up(self) -> None:
        if not self.ready:
            await warm_up_engine(self)

    generate, stream = generation_apis()

    # max_latency_ms bounds queueing + the forward; BentoML answers 503 to calls it predicts would miss it,
    # and 20 ms (tried first) turned away most of a cold burst of 24 callers on two CPU cores.
    @bentoml.api(batchable=True, max_batch_size=32, max_latency_ms=2000)
    def score(self, sequences: List[List[int]]) -> List[List[float]]:
        """Adaptive-batched teacher-forced forward: last-position logits per sequence.

        Internal (only the router is public). BentoML's batcher fails a batch as a unit, so a call
        with an out-of-vocabulary id gets its 400 and so do the calls batched with it."""
        if not hasattr(self.engine, "score"):
            raise InvalidArgument(f"score: not served by the {self.engine.name} engine (int8_engine: torchscript has it)")
        for seq in sequences:
            check_input(self, seq)
        out: List[Optional[List[float]]] = [None] * len(sequences)
        by_len: dict = {}
        for i, s in enumerate(sequences):
            by_len.setdefault(len(s), []).append(i)
        for idxs in by_len.values():
            for i, row in zip(idxs, self.engine.score([sequences[i] for i in idxs])):
                out[i] = row
        return out

    @bentoml.api
    def health(self) -> dict:
        return variant_health(self)


@bentoml.service(name="fp16-policy", workers=1, traffic={"timeout": TRAFFIC_TIMEOUT_S})
class Fp16Policy:
    variant = "fp16"
    model = bentoml.models.BentoModel(f"policy-fp16:{VERSION}")

    def __init__(self) -> None:
        copied = bool(settings_or_exit().trusted_keys)  # engine_dir then copies fp16/, hashing it as it reads
        path = engine_dir(self, open_entry(self, FP16_DIR, [FP16_DIR] if copied else []).parent, FP16_DIR)
        require = settings_or_exit().require_vllm
        # vLLM is expected where it is installed and not switched off (POLICY_BUNDLE_DISABLE_VLLM), or required
        self.vllm_expected = require or vllm_available(load=True)
        self.fallback_reason = None
        try:
            serving_faults.refuse_vllm()
            if not vllm_available(load=True):
                raise ImportError(f"vllm is {_vllm_missing()}")
            self.engine = VllmEngine(path, self.max_seq_len, first_token_s=batching_settings()["first_token_s"])
        except Exception as exc:  # noqa: BLE001 - the fallback serves; readiness says whether that was the plan
            if require:
                log.error("refusing to start: require_vllm is set and vLLM did not load: %s", exc)
                raise SystemExit(f"policy-bundle: require_vllm: vLLM did not load ({type(exc).__name__}: {exc})"[:500]) \
                    from None
            from policy_bundle.quantize.model.blocks import widen_narrow
            from policy_bundle.quantize.model.hf_weights import load_policy

            self.fallback_reason = f"{type(exc).__name__}: {exc}"[:300] + \
                "; serving the FP16 weights with our policy module (FP32)"
            log.warning("FP16 variant: %s", self.fallback_reason)
            # widened whole: a served decode step should not widen every layer again, and requests run on threads
            self.engine = policy_engine(widen_narrow(load_policy(path, max_seq_len=self.max_seq_len)), self.max_seq_len,
                                        "policy-module-fp32", step_hooks=serving_faults.step_hook, **batching_settings())
        self.ready = False

    @bentoml.on_startup
    async def warm_up(self) -> None:
        await warm_up_engine(self)

    generate, stream = generation_apis()

    @bentoml.api
    def health(self) -> dict:
        # expected_engine: False when vLLM was expected and the fallback loaded (the router is then not ready)
        return variant_health(self, fallback=self.fallback_reason,
                              expected_engine=not (self.vllm_expected and self.fallback_reason))
