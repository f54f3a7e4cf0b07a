"""PolicyRouter: the entry service. OpenAI-compatible API in front of the INT8 and FP16 variants, with
weighted/sticky routing, shadow traffic, a canaried rollout and an authenticated admin API.

Serve: ``bentoml serve policy_bundle.serve.router.service:PolicyRouter`` (after ``policy-bundle build``). The parts:
``openai_api`` (formats), ``pool`` (health, fail-over, admission), ``canary`` (window, shadow, golden,
analysis loops), ``admin`` (commands), ``rollout`` (state machine + SQLite), ``http`` (bodies, auth)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
from dataclasses import asdict
from typing import Optional

import bentoml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from policy_bundle.bundle.info import BundleInfo, load_tokenizer
from policy_bundle.bundle.layout import INT8_DIR
from policy_bundle.serve import logs, serving_faults
from policy_bundle.serve.router import admin
from policy_bundle.serve.router.canary import LiveCanary
from policy_bundle.serve.http import (TRAFFIC_TIMEOUT_S, ApiKeyGuard, ReleasingStream, error_response, read_json,
                                      require_admin, require_api_key)
from policy_bundle.serve.router.metrics import Metrics
from policy_bundle.serve.router.openai_api import Adapter, ChatAdapter, CompletionsAdapter, StreamTally, sse_events
from policy_bundle.serve.router.pool import VARIANTS, Admission, VariantPool, close_streams
from policy_bundle.serve.rollout.machine import RolloutController
from policy_bundle.serve.rollout.state import BundlePair, RolloutDatabase, StoreUnavailable, default_url, event_dict
from policy_bundle.serve.router.routing import choose, forced_variant, matched_variant
from policy_bundle.serve.schemas import ApiError, ChatRequest, CompletionRequest, openapi_operation, parse_request
from policy_bundle.serve.settings import settings_or_exit
from policy_bundle.serve.model_entries import bundle_pair, refuse, verified_artifact
from policy_bundle.serve.variants.services import VERSION, Fp16Policy, Int8Policy

log = logging.getLogger("policy_bundle.router")
# The spec is BentoML's /docs.json (it merges these routes); FastAPI's own copy would be a second one.
app = FastAPI(title="policy-bundle router", openapi_url=None, docs_url=None, redoc_url=None)
SETTINGS = settings_or_exit()  # a bad POLICY_BUNDLE_ROUTER_CONFIG stops start-up with one line, before anything loads
logs.configure(SETTINGS.log_format)


@app.exception_handler(405)
async def method_not_allowed(request: Request, exc) -> JSONResponse:
    """405 naming every method the path has (Starlette names only the first route's)."""
    allowed = sorted({m for r in app.routes if getattr(r, "path", None) == request.url.path
                      for m in getattr(r, "methods", ())})
    err = ApiError(405, f"method {request.method} is not allowed on {request.url.path}", "method", request.method,
                   ", ".join(allowed), code="method_not_allowed")
    return JSONResponse(err.body(), status_code=405, headers={"Allow": ", ".join(allowed)})


@bentoml.service(name="policy-router", workers=1, traffic={"timeout": TRAFFIC_TIMEOUT_S})
@bentoml.asgi_app(app, path="/")
class PolicyRouter:
    int8 = bentoml.depends(Int8Policy)
    fp16 = bentoml.depends(Fp16Policy)
    int8_model = bentoml.models.BentoModel(f"policy-int8:{VERSION}")  # tokenizer, golden set, manifest
    fp16_model = bentoml.models.BentoModel(f"policy-fp16:{VERSION}")  # its manifest must be int8's (one build)

    def __init__(self) -> None:
        self.settings = SETTINGS
        artifact = verified_artifact(self.int8_model, INT8_DIR, self.settings.trusted_keys)
        self.info = BundleInfo.read(artifact.parent)
        self.tok = load_tokenizer(artifact)
        self.metrics = Metrics()
        self.metrics.declare(VARIANTS)
        self.pair = bundle_pair(self.int8_model, self.fp16_model)
        url = self.settings.state_url or default_url(self.settings.state_dir)
        replica = f"{socket.gethostname()}:{os.getpid()}"
        try:
            self.db = RolloutDatabase(url, replica)
            self.controller = RolloutController(self.db, self.pair, self.settings.rollout, replica)
        except StoreUnavailable as exc:
            refuse(f"state_url: {exc}")
        self.admission = Admission(self.settings.max_inflight, self.settings.background_slots, self.metrics.set_inflight)
        self.pool = VariantPool({"int8": self.int8, "fp16": self.fp16}, self.settings, self.controller.note,
                                lambda name, exc, evidence: self.canary.record_error(name, exc, evidence), self.metrics,
                                expected_manifest=self.pair.int8_manifest)
        self.canary = LiveCanary(self.pool, self.admission, self.controller, self.info, self.tok, self.settings,
                                 self.metrics)
        self.adapters = {a.endpoint: a for a in (CompletionsAdapter(self.tok, self.info, self.settings.model_name),
                                                 ChatAdapter(self.tok, self.info, self.settings.model_name,
                                                             self.settings.chat_control_tokens))}
        self.fault = serving_faults.announced()  # announced in the log; reported by /status
        self._closing: set = set()  # streams being closed after their response ended (strong references)
        r = self.settings.rollout
        self.loops = {"health": (self.settings.health_interval_s, serving_faults.loop_tick(self.pool.refresh, "health")),
                      "analysis": (r.analysis_interval_s, serving_faults.loop_tick(self.canary.analysis_tick, "analysis")),
                      "sync": (r.sync_interval_s, self.canary.sync_tick),
                      "golden": (r.golden_interval_s, self.canary.golden_tick)}
        self.metrics.set_rollout(self.controller.state)
        if not self.settings.api_keys:
            log.warning("serving without API keys: every route, /status and /metrics included, is open to whoever "
                        "can reach this port; set POLICY_BUNDLE_API_KEYS (or api_keys in POLICY_BUNDLE_ROUTER_CONFIG)")
        log.info("router up: INT8 weight %.1f%% (%s, resumed=%s), context %d tokens", self.controller.state.weight,
                 self.controller.state.status, self.controller.resumed, self.info.max_seq_len)

    # -- lifecycle -----------------------------------------------------------------------------
    def ensure_loops(self) -> None:
        """Start (or restart) the health, analysis and golden loops from a request's context (dependency
        clients are bound to the serving event loop; a start-up hook saw them closed)."""
        if not self.canary.tasks:
            for name in VARIANTS:  # see VariantPool._retry_dropped: no session recycling under in-flight calls
                manager = getattr(getattr(self, name).to_async, "_session_manager", None)
                if manager is not None and hasattr(manager, "max_requests"):
                    manager.max_requests, manager.max_age = 2**62, float("inf")
        self.canary.ensure_loops(self.loops, first={"health": 0.0})

    async def __is_ready__(self) -> bool:
        self.ensure_loops()
        return self.pool.ready()

    # -- the request path ----------------------------------------------------------------------
    async def handle(self, request: Request, adapter: Adapter):
        self.ensure_loops()
        t0 = time.perf_counter()
        rid = logs.request_id(request.headers.get("x-request-id"))
        logs.REQUEST_ID.set(rid)  # this request's task: its log lines carry it
        response = await self._handle(request, adapter, t0, rid)
        response.headers["x-request-id"] = rid
        if not isinstance(response, ReleasingStream):  # a stream logs itself when it ends (_stream_outcome)
            log.info("request", extra={"endpoint": adapter.endpoint, "status": response.status_code,
                                       "variant": response.headers.get("x-policy-variant"),
                                       "seconds": round(time.perf_counter() - t0, 4)})
        return response

    async def _handle(self, request: Request, adapter: Adapter, t0: float, rid: str):
        try:
            require_api_key(request, self.settings.api_keys)
            data = await read_json(request, self.settings.max_body_bytes)  # before a slot: slow uploads hold none
            if not self.admission.try_acquire():  # the check and the count with no await between: a burst can't pass
                raise ApiError(429, "too many requests in flight; retry later", "concurrency", self.admission.inflight,
                               self.settings.max_inflight, code="rate_limited", headers={"Retry-After": "1"})
        except ApiError as err:
            return self._refuse(adapter, err)
        streaming, held = False, 1
        try:
            req = parse_request(adapter.schema, data)
            if req.model != self.settings.model_name:
                raise ApiError(404, f"model: {req.model!r} does not exist (serving {self.settings.model_name!r})",
                               "model", req.model, code="model_not_found")
            p = adapter.prepare(req)
            held = self._hold_choices(req.n)
            forced = forced_variant(request, self.settings.admin_token)
            variant = forced or matched_variant(request, self.settings.rollout.match, self.controller.stopped()) \
                or choose(self.controller.state.weight, self.settings.sticky_salt,
                                       req.user or request.headers.get("x-policy-user"))
            choices = [{**c, "request_id": rid} for c in p.sampling(self.tok.eos_token_id)]
            if req.stream:
                served, opened = await self.pool.open_stream(variant, forced is not None, choices)
                self.metrics.ttft.labels(variant=served).observe(time.perf_counter() - t0)
                streaming = True  # from here the response releases the slots, however the stream ends
                tally, steps, evidence = StreamTally(), [s for _, s in opened], forced is None
                body = sse_events(adapter, p, served, opened,
                                  [functools.partial(self.pool.next_step, served, s) for s in steps],
                                  self.tok.eos_token_id, tally, self.metrics.itl.labels(variant=served).observe,
                                  lambda exc: self.canary.record_error(served, exc, evidence))

                def ended() -> None:
                    try:
                        self._stream_outcome(adapter.endpoint, served, len(steps), tally, t0, evidence)
                    finally:  # the slots come back even if recording the outcome fails
                        self._stream_ended(body, steps, held)
                return ReleasingStream(body, ended, media_type="text/event-stream",
                                       headers={"x-policy-variant": served})
            served, results = await self.pool.generate(variant, forced is not None, choices)
        except ApiError as err:
            return self._refuse(adapter, err)
        finally:
            if not streaming:
                self.admission.release(count=held)
        self.canary.record(served, time.perf_counter() - t0, sum(len(r["token_ids"]) for r in results), forced is None)
        self.canary.maybe_shadow(served, choices[0], results[0]["token_ids"], forced is None and req.temperature == 0.0)
        return JSONResponse(adapter.complete(p, served, results), headers={"x-policy-variant": served})

    def _hold_choices(self, n: int) -> int:
        """The slots a request holds: one per choice (the first was taken before its body was read)."""
        if n > 1:
            if n > self.settings.max_inflight:
                raise ApiError(400, f"n: {n} choices exceed the {self.settings.max_inflight} calls this router runs "
                               "at once (max_inflight)", "n", n, self.settings.max_inflight)
            if not self.admission.try_acquire(count=n - 1):
                raise ApiError(429, f"too many requests in flight for {n} more choices; retry later", "concurrency",
                               self.admission.inflight, self.settings.max_inflight, code="rate_limited",
                               headers={"Retry-After": "1"})
        return n

    def _refuse(self, adapter: Adapter, err: ApiError) -> JSONResponse:
        self.metrics.rejected.labels(endpoint=adapter.endpoint, status=str(err.status)).inc()
        return error_response(err)

    def _stream_outcome(self, endpoint: str, served: str, choices: int, tally: StreamTally, t0: float,
                        evidence: bool) -> None:
        """A streamed answer is over: recorded for the canary if it ended with ``[DONE]``, and logged either way
        (a failure mid-stream was recorded by ``sse_events`` as it happened)."""
        if tally.done:
            self.canary.record(served, time.perf_counter() - t0, tally.tokens, evidence)
        log.info("request", extra={"endpoint": endpoint, "status": 200 if tally.done else "incomplete",
                                   "variant": served, "tokens": tally.tokens, "choices": choices,
                                   "seconds": round(time.perf_counter() - t0, 4)})

    def _stream_ended(self, body, steps: list, held: int = 1) -> None:
        """A streamed response is over (sent, cut off mid-stream, or its client gone before the body started,
        when Starlette never starts the body and its ``finally`` never runs): the slots are free at once; the
        streams close in a task of their own, which a cancelled request's scope cannot cut short (the one
        place they are closed)."""
        self.admission.release(count=held)
        task = asyncio.ensure_future(close_streams(body, *steps))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # -- HTTP routes ---------------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=openapi_operation(CompletionRequest, SETTINGS.model_name))
    async def completions(self, request: Request):
        return await self.handle(request, self.adapters["completions"])

    @app.post("/v1/chat/completions", openapi_extra=openapi_operation(ChatRequest, SETTINGS.model_name))
    async def chat_completions(self, request: Request):
        return await self.handle(request, self.adapters["chat"])

    @app.get("/v1/models")
    async def models(self, request: Request):
        return self._guarded(request) or {"object": "list", "data": [{
            "id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "policy-bundle",
            "max_model_len": self.info.max_seq_len}]}  # as vLLM publishes it: prompt + answer tokens at most

    @app.get("/status")
    async def status(self, request: Request):
        """The health the probe loop last saw (no probe, no write per GET), the rollout, the loops."""
        self.ensure_loops()
        return self._guarded(request) or {
            "ready": self.pool.ready(), "degraded": self.pool.degraded(), "variants": self.pool.health, "rollout": asdict(self.controller.state),
            "pair": asdict(self.pair), "state_version": self.controller.version,
            "rollout_database": self.controller.database_status(), "inflight": self.admission.inflight,
            "background_inflight_peak": self.admission.background_peak, "context_tokens": self.info.max_seq_len,
            "evidence_excluded": {"forced_requests": dict(self.canary.excluded),
                                  "why": "a variant forced by the admin token is not rollout evidence"},
            "loops": {name: not task.done() for name, task in self.canary.tasks.items()},
            "test_fault": self.fault is not None}

    def _guarded(self, request: Request, admin_api: bool = False) -> Optional[JSONResponse]:
        try:
            require_admin(request, self.settings.admin_token) if admin_api else \
                require_api_key(request, self.settings.api_keys)
        except ApiError as err:
            return error_response(err)
        return None

    @app.get("/admin/rollout")
    async def admin_status(self, request: Request):
        return self._guarded(request, True) or {"state": asdict(self.controller.state), "pair": asdict(self.pair),
                                                "state_version": self.controller.version,
                                                "config": asdict(self.settings.rollout)}

    @app.get("/admin/rollout/history")
    async def admin_history(self, request: Request):
        """The newest ``?limit=`` events (default 1000, oldest first) of the current pair, or of an earlier one
        (``?pair=<int8 manifest sha256>``, as ``/admin/rollout/pairs`` lists them), and how many it holds."""
        denied = self._guarded(request, True)
        if denied:
            return denied
        try:
            limit = admin.history_limit(request.query_params.get("limit", "1000"))
            pair = await asyncio.to_thread(admin.pair_named, self.db, self.pair, request.query_params.get("pair"))
            events, total = await asyncio.to_thread(self._history, pair, limit)
        except ApiError as err:
            return error_response(err)
        except StoreUnavailable as exc:
            return error_response(ApiError(503, str(exc), code="service_unavailable"))
        return {"pair": asdict(pair), "history": [event_dict(e) for e in events], "total": total,
                "pending_notes": len(self.controller.pending)}

    def _history(self, pair: BundlePair, limit: int) -> tuple:
        self.controller.flush()  # notes queued on the event loop are history too
        return self.db.history(pair, limit), self.db.count(pair)

    @app.get("/admin/rollout/pairs")
    async def admin_pairs(self, request: Request):
        """Every bundle pair the state database has a rollout for, newest first (earlier builds stay readable)."""
        denied = self._guarded(request, True)
        if denied:
            return denied
        try:
            return {"current": asdict(self.pair), "pairs": await asyncio.to_thread(self.db.pairs)}
        except StoreUnavailable as exc:
            return error_response(ApiError(503, str(exc), code="service_unavailable"))

    @app.post("/admin/rollout", openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": admin.admin_schema()}}},
        "responses": {str(s): {"description": d} for s, d in ((400, "invalid command"), (401, "no token"),
                                                               (403, "bad token or admin disabled"),
                                                               (503, "golden canary failed"))}})
    async def admin_command(self, request: Request):
        denied = self._guarded(request, True)
        if denied:
            return denied
        try:
            return await admin.execute(await read_json(request, self.settings.max_body_bytes), self.canary,
                                       self.controller, self.metrics)
        except ApiError as err:
            return error_response(err)


PolicyRouter.add_asgi_middleware(ApiKeyGuard, keys=SETTINGS.api_keys)
