"""PolicyRouter: the entry service. OpenAI-compatible API in front of the INT8 and FP16 variants,
with weighted/sticky routing, shadow traffic, a canaried rollout and an authenticated admin API.

Serve: ``bentoml serve policy_bundle.serve.service:PolicyRouter`` (after ``policy-bundle build``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import random
import time
import uuid
from dataclasses import asdict
from typing import List, Optional, Tuple

import bentoml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from policy_bundle.serve.metrics import Metrics
from policy_bundle.serve.rollout import RolloutController, RolloutStore, Window, analyse
from policy_bundle.serve.schemas import ADMIN_COMMAND, ApiError, ChatRequest, CompletionRequest, openapi_operation, parse_request
from policy_bundle.serve.settings import load_settings
from policy_bundle.serve.variants import VERSION, Fp16Policy, Int8Policy, verified_artifact

log = logging.getLogger("policy_bundle.router")
# The spec is BentoML's /docs.json (it merges these routes); FastAPI's own copy would be a second one.
app = FastAPI(title="policy-bundle router", openapi_url=None, docs_url=None, redoc_url=None)


class VariantDown(RuntimeError):
    """The variant a request waited for was marked down by the health loop."""


@app.exception_handler(405)
async def method_not_allowed(request: Request, exc) -> JSONResponse:
    """405 naming every method the path has (Starlette names only the first route's)."""
    allowed = sorted({m for r in app.routes if getattr(r, "path", None) == request.url.path
                      for m in getattr(r, "methods", ())})
    err = ApiError(405, f"method {request.method} is not allowed on {request.url.path}", "method", request.method,
                   ", ".join(allowed), code="method_not_allowed")
    return JSONResponse(err.body(), status_code=405, headers={"Allow": ", ".join(allowed)})


VARIANTS = ("int8", "fp16")
MODEL_NAME = load_settings().model_name  # for the published spec


def other_variant(name: str) -> str:
    return "fp16" if name == "int8" else "int8"


def sticky_bucket(salt: str, user: str) -> float:
    """A stable position in [0, 100) for a user: same user, same weight -> same variant."""
    digest = hashlib.sha256(f"{salt}:{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100.0


def check_token(given: Optional[str], expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def bearer(request: Request) -> Optional[str]:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


@bentoml.service(name="policy-router", workers=1, traffic={"timeout": 300})
@bentoml.asgi_app(app, path="/")
class PolicyRouter:
    int8 = bentoml.depends(Int8Policy)
    fp16 = bentoml.depends(Fp16Policy)
    int8_model = bentoml.models.BentoModel(f"policy-int8:{VERSION}")  # tokenizer, golden set, manifest

    def __init__(self) -> None:
        from policy_bundle.bundle.info import load_tokenizer, read_golden_jsonl

        self.settings = load_settings()
        artifact = verified_artifact(self.int8_model, "int8")
        self.tok = load_tokenizer(artifact)
        self.golden = read_golden_jsonl(artifact.parent / "golden.jsonl")
        manifest = json.loads((artifact.parent / "bundle.json").read_text())
        self.max_new_default = manifest["config"]["prompts"]["max_new_tokens"]
        self.has_task = manifest["config"]["policy"]["source"] == "reference" and not manifest["config"]["prompts"]["file"]
        self.max_seq_len = min(manifest["config"]["policy"]["max_seq_len"],
                               json.loads((artifact / "config.json").read_text()).get("max_position_embeddings", 10**9))
        self.store = RolloutStore(self.settings.state_dir)
        self.controller = RolloutController(self.store, self.settings.rollout)
        self.window = Window()
        self.inflight = 0
        self.metrics = Metrics()
        self.golden_cursor = 0
        self.metrics.weight.set(self.controller.state.weight)
        self.tasks: List[asyncio.Task] = []
        self.variants_down: set = set()
        self.ever_ready: set = set()  # variants that answered a probe ready at least once
        self.probe_failures: dict = {}  # variant -> failed probes in a row
        self.down_events: dict = {}  # variant -> asyncio.Event, set while it is down
        log.info("router up: INT8 weight %.1f%% (%s, resumed=%s)", self.controller.state.weight,
                 self.controller.state.status, self.controller.resumed)

    # -- lifecycle -----------------------------------------------------------------------------
    def ensure_loops(self) -> None:
        """Start the analysis and golden-canary loops from a request's context (the dependency
        clients are bound to the serving event loop; a startup-hook task saw them closed)."""
        if not self.tasks:
            for name in VARIANTS:  # see _retry_dropped: no session recycling under in-flight calls
                manager = getattr(self._svc(name).to_async, "_session_manager", None)
                if manager is not None and hasattr(manager, "max_requests"):
                    manager.max_requests, manager.max_age = 2**62, float("inf")
            self.tasks = [asyncio.create_task(self._analysis_loop()), asyncio.create_task(self._golden_loop()),
                          asyncio.create_task(self._health_loop())]

    async def __is_ready__(self) -> bool:
        self.ensure_loops()
        health = await self._variant_health()
        return all(h.get("ready") for h in health.values())

    async def _probe(self, name: str) -> dict:
        try:
            return await self._retry_dropped(lambda: asyncio.wait_for(self._svc(name).to_async.health(),
                                                                      self.settings.health_timeout_s))
        except Exception as exc:  # noqa: BLE001 - a dead variant is a state to report, not raise
            return {"ready": False, "error": f"{type(exc).__name__}: {exc}"[:300], "timed_out":
                    isinstance(exc, asyncio.TimeoutError)}

    async def _retry_dropped(self, make_call):
        """Run ``make_call()``; once more if the connection was dropped under it. BentoML's dependency
        client closes its whole aiohttp session every ``max_requests`` calls while others still use it
        (bentoml/BentoML#5540, #5544), and idle keep-alive connections race with the server closing
        them: either way the call failed before the variant could answer, and generation is pure."""
        import aiohttp

        try:
            return await make_call()
        except aiohttp.ClientConnectionError:
            return await make_call()

    async def _variant_health(self) -> dict:
        out = dict(zip(VARIANTS, await asyncio.gather(*[self._probe(name) for name in VARIANTS])))
        for name, health in out.items():
            ready = bool(health.get("ready"))
            self.probe_failures[name] = 0 if ready else self.probe_failures.get(name, 0) + 1
            if ready:
                self.ever_ready.add(name)
            # Down, for routing and history, once a variant that was ready (start-up is not history) stops
            # answering its probe (a SIGKILLed BentoML worker: the arbiter keeps its socket open, so the
            # probe times out), or refuses connections for 3 probes in a row (its listener is gone; a
            # shutting-down server does that for a moment, and that is not an event worth keeping).
            down = not ready and (health.get("timed_out") or self.probe_failures[name] >= 3)
            if down and name in self.ever_ready and name not in self.variants_down:
                self.variants_down.add(name)
                self.controller.note("variant-down", f"{name}: {health.get('error')}", {"variant": name})
            elif ready and name in self.variants_down:
                self.variants_down.discard(name)
                self.down_events[name] = asyncio.Event()
                self.controller.note("variant-up", f"{name}: ready again", {"variant": name})
            if name in self.variants_down and health.get("timed_out"):
                # Requests waiting on a variant that does not answer would wait for its restart: fail them
                # over now. (Not on refusals: during a graceful shutdown in-flight requests still finish.)
                self.down_events.setdefault(name, asyncio.Event()).set()
        fallback = 1.0 if out.get("fp16", {}).get("fallback") else 0.0
        self.metrics.fp16_fallback.set(fallback)
        return out

    def _svc(self, name: str):
        return self.int8 if name == "int8" else self.fp16

    async def call_variant(self, name: str, **kwargs) -> dict:
        """``generate`` on a variant within the request timeout, given up early if the variant is
        found dead, retried once on a dropped connection."""
        return await self._retry_dropped(
            lambda: self._unless_down(name, self._svc(name).to_async.generate(**kwargs)))

    async def _unless_down(self, name: str, call):
        """Await ``call`` within the request timeout, but give up as soon as the health loop marks
        ``name`` down: the caller then retries on the other variant (generation is side-effect free)."""
        down = self.down_events.setdefault(name, asyncio.Event())
        task, waiter = asyncio.ensure_future(call), asyncio.ensure_future(down.wait())
        try:
            done, _ = await asyncio.wait({task, waiter}, timeout=self.settings.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task in done:
            return task.result()
        task.cancel()
        if waiter in done:
            raise VariantDown(f"{name} failed its health probe while this request waited for it")
        raise asyncio.TimeoutError(f"{name} did not answer in {self.settings.request_timeout_s}s")

    # -- routing -------------------------------------------------------------------------------
    def choose(self, user: Optional[str]) -> str:
        weight = self.controller.state.weight
        pos = sticky_bucket(self.settings.sticky_salt, user) if user else random.random() * 100.0
        chosen = "int8" if pos < weight else "fp16"
        other = other_variant(chosen)
        if chosen in self.variants_down and other not in self.variants_down:
            self.metrics.rerouted.labels(variant=chosen).inc()
            return other
        return chosen

    def forced_variant(self, request: Request) -> Optional[str]:
        forced = request.headers.get("x-policy-variant")
        if forced is None:
            return None
        if forced not in VARIANTS:
            raise ApiError(400, f"x-policy-variant: {forced!r} is not one of {list(VARIANTS)}", "x-policy-variant", forced)
        if not self.settings.admin_token:
            raise ApiError(403, "x-policy-variant needs the admin API, which is disabled (no admin token configured)",
                           "x-policy-variant", code="permission_denied")
        if not check_token(request.headers.get("x-admin-token"), self.settings.admin_token):
            raise ApiError(403, "x-policy-variant needs a valid x-admin-token header", "x-admin-token",
                           code="permission_denied")
        return forced

    def check_api_key(self, request: Request) -> None:
        if not self.settings.api_keys:
            return
        key = bearer(request)
        if key is None or not any(check_token(key, k) for k in self.settings.api_keys):
            raise ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)", "authorization",
                           code="invalid_api_key")

    async def read_json(self, request: Request):
        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"request body of {length} bytes exceeds the limit", "body", int(length), limit)
        body = await request.body()
        if len(body) > limit:
            raise ApiError(413, f"request body of {len(body)} bytes exceeds the limit", "body", len(body), limit)
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"body is not valid JSON ({exc})", "body") from None

    def encode(self, text: str, chat: bool) -> List[int]:
        from policy_bundle.bundle.info import encode_prompt

        if not text.strip():
            raise ApiError(400, "prompt: must not be empty", "messages" if chat else "prompt", text)
        return encode_prompt(self.tok, text)

    def check_length(self, ids: List[int], max_tokens: int, field: str) -> None:
        if len(ids) + max_tokens > self.max_seq_len:
            raise ApiError(400, f"{field}: {len(ids)} prompt tokens + max_tokens {max_tokens} exceed the context",
                           field, len(ids) + max_tokens, self.max_seq_len)

    # -- the shared request path ---------------------------------------------------------------
    async def handle(self, request: Request, chat: bool):
        self.ensure_loops()
        t0 = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        try:
            self.check_api_key(request)
            if self.inflight >= self.settings.max_inflight:  # first: turning a request away must stay cheap
                raise ApiError(429, "too many requests in flight; retry later", "concurrency", self.inflight,
                               self.settings.max_inflight, code="rate_limited", headers={"Retry-After": "1"})
            req = parse_request(ChatRequest if chat else CompletionRequest, await self.read_json(request))
            if req.model != self.settings.model_name:
                raise ApiError(404, f"model: {req.model!r} does not exist (serving {self.settings.model_name!r})",
                               "model", req.model, code="model_not_found")
            if chat:
                text = "\n".join(m.content for m in req.messages)
            else:
                if isinstance(req.prompt, list) and len(req.prompt) != 1:
                    raise ApiError(400, "prompt: exactly one prompt per request", "prompt", len(req.prompt), 1)
                text = req.prompt[0] if isinstance(req.prompt, list) else req.prompt
            ids = self.encode(text, chat)
            max_tokens = (getattr(req, "max_completion_tokens", None) or req.max_tokens or self.max_new_default)
            self.check_length(ids, max_tokens, "messages" if chat else "prompt")
            forced = self.forced_variant(request)
        except ApiError as err:
            self.metrics.rejected.labels(endpoint=endpoint, status=str(err.status)).inc()
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        user = req.user or request.headers.get("x-policy-user")
        variant = forced or self.choose(user)
        kwargs = dict(prompt_ids=ids, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                      seed=req.seed, stop_token_id=self.tok.eos_token_id)
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        if req.stream:
            return StreamingResponse(self._stream(req, chat, variant, forced is not None, kwargs, t0),
                                     media_type="text/event-stream", headers={"x-policy-variant": variant})
        try:
            served, result = await self._generate(variant, forced is not None, kwargs)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        finally:
            self.inflight -= 1
            self.metrics.inflight.set(self.inflight)
        self._record(served, time.perf_counter() - t0, len(result["token_ids"]))
        if forced is None and req.temperature == 0.0 and random.random() < self.settings.rollout.shadow_fraction:
            asyncio.create_task(self._shadow(served, kwargs, result["token_ids"]))
        body = self._body(req, chat, served, ids, result)
        return JSONResponse(body, headers={"x-policy-variant": served})

    async def _generate(self, variant: str, forced: bool, kwargs: dict) -> Tuple[str, dict]:
        """Primary variant, then the other one if it errors or times out (unless forced)."""
        order = [variant] if forced else [variant, other_variant(variant)]
        last = None
        for name in order:
            try:
                return name, await self.call_variant(name, **kwargs)
            except Exception as exc:  # noqa: BLE001 - any variant failure is retried on the other
                last = exc
                self._record_error(name, exc)
        raise ApiError(503, f"no variant could answer ({type(last).__name__})", code="service_unavailable",
                       headers={"Retry-After": "1"})

    async def _stream(self, req, chat: bool, variant: str, forced: bool, kwargs: dict, t0: float):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        order = [variant] if forced else [variant, other_variant(variant)]
        sent, served = 0, variant
        try:
            for name in order:
                served = name
                try:
                    agen = self._svc(name).to_async.stream(**kwargs)
                    async for line in agen:
                        for item in filter(None, line.splitlines()):
                            step = json.loads(item)
                            text = self.tok.decode([step["token_id"]], skip_special_tokens=True)
                            sent += 1
                            yield self._sse_chunk(rid, chat, name, text, step, None, req)
                    break
                except Exception as exc:  # noqa: BLE001 - retry on the other variant if nothing was sent
                    self._record_error(name, exc)
                    if sent:
                        yield f"data: {json.dumps({'error': {'message': 'variant failed mid-stream'}})}\n\n"
                        return
            yield self._sse_chunk(rid, chat, served, "", None, "stop" if sent < kwargs["max_tokens"] else "length", req)
            yield "data: [DONE]\n\n"
            self._record(served, time.perf_counter() - t0, sent)
        finally:
            self.inflight -= 1
            self.metrics.inflight.set(self.inflight)

    def _sse_chunk(self, rid: str, chat: bool, variant: str, text: str, step, finish, req) -> str:
        base = {"id": rid, "created": int(time.time()), "model": self.settings.model_name, "policy_variant": variant}
        if chat:
            delta = {"content": text} if step is not None else {}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            body = {**base, "object": "chat.completion.chunk", "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            body = {**base, "object": "text_completion", "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    def _body(self, req, chat: bool, variant: str, prompt_ids: List[int], result: dict) -> dict:
        ids = result["token_ids"]
        eos = self.tok.eos_token_id
        finish = "stop" if ids and ids[-1] == eos else "length"
        text = self.tok.decode(ids, skip_special_tokens=True)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                 "total_tokens": len(prompt_ids) + len(ids)}
        base = {"created": int(time.time()), "model": self.settings.model_name, "policy_variant": variant,
                "usage": usage}
        tokens = [self.tok.decode([t]) for t in ids]
        if chat:
            lp = None
            if req.logprobs:
                lp = {"content": [{"token": t, "logprob": p, "bytes": list(t.encode()), "top_logprobs": []}
                                  for t, p in zip(tokens, result["logprobs"])]}
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                      "logprobs": lp}
            return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", **base, "choices": [choice]}
        lp = None
        if req.logprobs is not None:
            lp = {"tokens": tokens, "token_logprobs": result["logprobs"], "top_logprobs": None, "text_offset": None}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", **base, "choices": [choice]}

    # -- bookkeeping ---------------------------------------------------------------------------
    def _record(self, variant: str, seconds: float, tokens: int) -> None:
        self.window.requests[variant] += 1
        lat = self.window.latencies[variant]
        lat.append(seconds)
        del lat[:-5000]
        self.metrics.requests.labels(variant=variant).inc()
        self.metrics.latency.labels(variant=variant).observe(seconds)
        self.metrics.tokens.labels(variant=variant).inc(tokens)

    def _record_error(self, variant: str, exc: Exception) -> None:
        log.warning("variant %s failed: %s: %s", variant, type(exc).__name__, str(exc)[:200])
        self.window.requests[variant] += 1
        self.window.errors[variant] += 1
        self.metrics.errors.labels(variant=variant).inc()

    async def _shadow(self, served: str, kwargs: dict, primary_ids: List[int]) -> None:
        other = other_variant(served)
        if other in self.variants_down:  # already counted as down: no comparison to make
            return
        try:
            res = await self.call_variant(other, **kwargs)
        except Exception as exc:  # noqa: BLE001 - shadow failures count, the client already has its answer
            self._record_error(other, exc)
            return
        same = res["token_ids"] == primary_ids
        self.window.shadow_pairs += 1
        self.window.shadow_same += int(same)
        self.metrics.shadow.labels(outcome="same" if same else "different").inc()

    async def run_golden_canary(self) -> dict:
        """Golden items through both variants, compared with the build's FP32 completions (same metric code)."""
        from policy_bundle.quantize import task
        from policy_bundle.quantize.fidelity import FidelityReport, completion_metrics

        n = min(self.settings.rollout.golden_items, len(self.golden))
        items = [self.golden[(self.golden_cursor + i) % len(self.golden)] for i in range(n)]
        self.golden_cursor += n
        outs = {}
        for name in VARIANTS:
            res = await asyncio.gather(*[self.call_variant(
                name, prompt_ids=it.prompt_ids, max_tokens=self.max_new_default, temperature=0.0,
                stop_token_id=self.tok.eos_token_id) for it in items])
            outs[name] = [r["token_ids"] for r in res]
        decode = lambda ids: self.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        reward = task.reward if self.has_task else None
        ref = [it.completion_ids for it in items]
        blank = lambda: FidelityReport(items=n, tokens=0, top1_agreement=float("nan"), kl_mean=float("nan"), kl_p99=float("nan"))  # noqa: E731
        int8 = completion_metrics(blank(), items, ref, outs["int8"], decode, reward).summary()
        fp16 = completion_metrics(blank(), items, ref, outs["fp16"], decode, reward).summary()
        summary = {"items": n, "greedy_agreement": int8["greedy_agreement"],
                   "fp16_greedy_agreement": fp16["greedy_agreement"],
                   "reward_int8": int8.get("reward_candidate"), "reward_fp16": fp16.get("reward_candidate")}
        if int8.get("reward_candidate") is not None and fp16.get("reward_candidate") is not None:
            summary["reward_delta"] = int8["reward_candidate"] - fp16["reward_candidate"]
        return summary

    async def _health_loop(self) -> None:
        """Probe both variants every ``health_interval_s``: ``choose`` sends no new traffic to one
        that is down (a killed worker's socket stays open while BentoML restarts it, so requests
        sent there would wait for the restart instead of failing over)."""
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            await self._variant_health()

    async def _golden_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.rollout.golden_interval_s)
            if self.controller.state.status not in ("progressing", "waiting"):
                continue
            try:
                self.window.golden = await self.run_golden_canary()
            except Exception as exc:  # noqa: BLE001 - a failed canary run is an INT8/FP16 error signal
                log.warning("golden canary run failed: %s", exc)
                self.window.errors["int8"] += 1

    async def _analysis_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.rollout.analysis_interval_s)
            self.analyse_now()

    def analyse_now(self) -> dict:
        window, self.window = self.window, Window()
        verdict, reasons, metrics = analyse(window, self.settings.rollout)
        failures = {v: n for v, n in window.errors.items() if n}
        if failures:  # crashes and timeouts are history even when the rollout is paused or done
            self.controller.note("variant-errors", ", ".join(f"{n} {v} failure(s)" for v, n in failures.items())
                                 + " in the last window (requests retried on the other variant)", metrics)
        if self.controller.state.status in ("progressing", "waiting"):
            self.metrics.verdicts.labels(verdict=verdict).inc()
            self.controller.apply(verdict, reasons, metrics)
        self.metrics.weight.set(self.controller.state.weight)
        if window.shadow_pairs:
            self.metrics.shadow_agreement.set(window.shadow_same / window.shadow_pairs)
        return {"verdict": verdict, "reasons": reasons, "metrics": metrics}

    # -- HTTP routes ---------------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=openapi_operation(CompletionRequest, MODEL_NAME))
    async def completions(self, request: Request):
        return await self.handle(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=openapi_operation(ChatRequest, MODEL_NAME))
    async def chat_completions(self, request: Request):
        return await self.handle(request, chat=True)

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "policy-bundle"}]}

    @app.get("/status")
    async def status(self):
        health = await self._variant_health()
        return {"ready": all(h.get("ready") for h in health.values()), "variants": health,
                "rollout": asdict(self.controller.state), "inflight": self.inflight}

    def admin_guard(self, request: Request) -> Optional[JSONResponse]:
        if not self.settings.admin_token:
            err = ApiError(403, "admin API is disabled: set POLICY_BUNDLE_ADMIN_TOKEN to enable it", code="admin_disabled")
        elif bearer(request) is None:
            err = ApiError(401, "admin API needs Authorization: Bearer <admin token>", "authorization",
                           code="unauthorized")
        elif not check_token(bearer(request), self.settings.admin_token):
            err = ApiError(403, "admin token is not valid", "authorization", code="permission_denied")
        else:
            return None
        return JSONResponse(err.body(), status_code=err.status)

    @app.get("/admin/rollout")
    async def admin_status(self, request: Request):
        return self.admin_guard(request) or {"state": asdict(self.controller.state),
                                             "config": asdict(self.settings.rollout)}

    @app.get("/admin/rollout/history")
    async def admin_history(self, request: Request):
        return self.admin_guard(request) or {"history": [asdict(e) for e in self.store.history()]}

    @app.post("/admin/rollout", openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": ADMIN_COMMAND}}},
        "responses": {str(s): {"description": d} for s, d in ((400, "invalid command"), (401, "no token"),
                                                               (403, "bad token or admin disabled"),
                                                               (503, "golden canary failed"))}})
    async def admin_command(self, request: Request):
        denied = self.admin_guard(request)
        if denied:
            return denied
        try:
            body = await self.read_json(request)
            if not isinstance(body, dict):
                raise ApiError(400, "request body must be a JSON object with an 'action'", "body")
            action = body.get("action")
            if action == "analyse":
                return self.analyse_now()
            if action == "golden-canary":
                try:
                    self.window.golden = await self.run_golden_canary()
                except Exception as exc:  # noqa: BLE001 - report, don't 500
                    raise ApiError(503, f"golden canary run failed: {type(exc).__name__}: {exc}"[:300],
                                   code="service_unavailable") from None
                return {"golden": self.window.golden}
            weight = body.get("weight")
            if action == "set-weight" and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                                           or not 0 <= weight <= 100):
                raise ApiError(400, "weight: must be a number in [0, 100]", "weight", weight, 100)
            reason = body.get("reason", "operator")
            if not isinstance(reason, str) or len(reason) > 500:
                raise ApiError(400, "reason: must be a string of at most 500 characters", "reason",
                               len(reason) if isinstance(reason, str) else reason, 500)
            state = self.controller.command(str(action), weight, reason)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except ValueError as exc:
            return JSONResponse(ApiError(400, str(exc), "action").body(), status_code=400)
        self.metrics.weight.set(state.weight)
        return {"state": asdict(state)}
