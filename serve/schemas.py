"""HTTP payloads (OpenAI-compatible subset) and the one error shape every 4xx uses."""

from __future__ import annotations

import math
from typing import Annotated, Dict, List, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StringConstraints, ValidationError,
                      ValidationInfo, field_validator)

# Below this, sampling is greedy (as in vLLM, whose sampler's epsilon it is): logits / 1e-320 overflow to inf
# and NaN probabilities, which must not be a variant's failure, let alone count towards a rollback.
MIN_TEMPERATURE = 1e-5
TEXT = {"type": "string", "pattern": r"\S"}  # not empty, not only whitespace (the server checks it itself)
MAX_STOP, MAX_STOP_CHARS = 4, 64
STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
StopText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


def _published(schema: dict):
    """``json_schema_extra`` that replaces a field's published schema (validation stays the field's
    own, so its error messages stay the ones clients see)."""
    def apply(field_schema: dict) -> None:
        field_schema.clear()
        field_schema.update(schema)
    return apply


class ApiError(Exception):
    """A client error: HTTP status plus the field, the value and the limit it broke."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, value=None, limit=None,
                 code: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.value, self.limit = status, message, param, value, limit
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        """Always serializable as strict JSON (finite numbers, valid Unicode), whatever the client sent."""
        err = {"message": _text(self.message), "type": self.code, "param": _text(self.param), "code": self.code}
        if self.value is not None:
            err["value"] = _json_safe(self.value)
        if self.limit is not None:
            err["limit"] = _json_safe(self.limit)
        return {"error": err}


def _text(s: Optional[str]) -> Optional[str]:
    """``s`` with unpaired surrogates replaced, at most 500 characters."""
    return None if s is None else str(s)[:500].encode("utf-8", "replace").decode("utf-8")


def _json_safe(v):
    if isinstance(v, bool) or (isinstance(v, int) and abs(v) < 2**63):
        return v
    if isinstance(v, float) and math.isfinite(v):
        return v
    return _text(v if isinstance(v, str) else repr(v)[:200])


# Fields of the OpenAI (and vLLM) APIs this server does not implement: accepted at a value that means "off" (null
# included; vLLM's benchmark client sends repetition_penalty 1.0), refused by name at any other (answering as if
# they were not there would answer another request than the one asked). Any other unknown field is refused too.
NOT_IMPLEMENTED = {
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},), "repetition_penalty": (1,),
    "best_of": (1,), "suffix": ("",), "top_k": (-1, 0), "min_p": (0,), "min_tokens": (0,), "store": (False,),
}
MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 300, 20, 5  # OpenAI's limits
MAX_CHOICES = 16  # n: each choice is a sequence the variant decodes in its batch and holds an admission slot
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MESSAGE_NOT_IMPLEMENTED = {"tool_calls": ([],), "name": (), "tool_call_id": (), "function_call": ()}


def _is_off(value, options) -> bool:
    """``value`` means the field is off: null, or one of ``options`` (a bool never stands for 0 or 1)."""
    return value is None or any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in options)


def refuse_unknown(data: dict, known, not_implemented: dict, where: str = "") -> None:
    """A 400 naming the first field of ``data`` the model does not have: one this server does not implement (at a
    value that is not off), or one it does not know."""
    for key, value in data.items():
        if key in known:
            continue
        name = f"{where}{key}"
        if key in not_implemented:
            if _is_off(value, not_implemented[key]):
                continue
            off = not_implemented[key]
            raise ApiError(400, f"{name}: not implemented by this server" + (
                f" (accepted only as null or {' / '.join(repr(o) for o in off)})" if off else " (accepted only as null)"),
                name, value, code="unsupported_parameter")
        raise ApiError(400, f"{name}: unknown field", name, code="unknown_parameter")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: StrictBool = False  # one more chunk before [DONE]: empty choices, the request's usage


class _ApiRequest(BaseModel):
    # strict: "0.5" is not a temperature and true is not a number (a JSON int is a float, as JSON has one number)
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    # up to the context less the prompt (Adapter.prepare: the numbers in the 400); /v1/models says max_model_len
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0,
                               description=f"0 (or below {MIN_TEMPERATURE}): greedy; else sampling at that temperature")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Optional[StrictInt] = Field(default=None, ge=0, le=2**63 - 1)
    user: Optional[str] = Field(default=None, max_length=256)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: StrictBool = False  # vLLM's extension: generate max_tokens tokens, EOS or not
    # choices, decoded side by side in one variant's batch; with a seed, choice i samples with seed + i
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    # token id (a string, as JSON keys are) -> added to its logit before sampling, greedy included
    logit_bias: Optional[Dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]] = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    presence_penalty: Penalty = 0.0  # subtracted from a token's logit once it is in the answer
    frequency_penalty: Penalty = 0.0  # subtracted per time it is in the answer
    stop: Optional[Union[StopText, List[StopText]]] = Field(default=None, json_schema_extra=_published(
        {"anyOf": [STOP, {"type": "array", "items": STOP, "maxItems": MAX_STOP}], "nullable": True}))

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, value: float) -> float:
        return 0.0 if value < MIN_TEMPERATURE else value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream", False):
            raise ValueError("only allowed with stream: true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value):
        bad = next((k for k in value or {} if not (k.isascii() and k.isdigit())), None)
        if bad is not None:
            raise ValueError(f"{bad!r} is not a token id (a non-negative integer as a string)")
        return value

    def sampling_modifiers(self, top_logprobs: int) -> dict:
        """What the variants apply per step besides temperature and top_p (only what is set)."""
        out = {}
        if self.logit_bias:
            out["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        if self.presence_penalty:
            out["presence_penalty"] = self.presence_penalty
        if self.frequency_penalty:
            out["frequency_penalty"] = self.frequency_penalty
        if top_logprobs:
            out["top_logprobs"] = top_logprobs
        return out

    def stop_strings(self) -> List[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise ApiError(400, f"stop: at most {MAX_STOP} stop strings", "stop", len(stop), MAX_STOP)
        return stop


class CompletionRequest(_ApiRequest):
    prompt: Union[str, List[str]] = Field(json_schema_extra=_published(
        {"anyOf": [TEXT, {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 1}]}))
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False

    def top_logprobs_wanted(self) -> int:
        return self.logprobs or 0


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str = Field(json_schema_extra=_published(TEXT))


class ChatRequest(_ApiRequest):
    messages: List[ChatMessage] = Field(min_length=1, max_length=64)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs", False):
            raise ValueError("only allowed with logprobs: true")
        return value

    def top_logprobs_wanted(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


def parse_request(model: type[BaseModel], data) -> BaseModel:
    """Validate a JSON body; the first problem becomes a 400 naming the field, value and limit."""
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", param=None)
    refuse_unknown(data, model.model_fields, NOT_IMPLEMENTED)
    for i, message in enumerate(data.get("messages") or [] if model is ChatRequest else []):
        if isinstance(message, dict):
            refuse_unknown(message, ChatMessage.model_fields, MESSAGE_NOT_IMPLEMENTED, f"messages.{i}.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        e = exc.errors()[0]
        field = ".".join(str(p) for p in e["loc"]) or None
        ctx = e.get("ctx") or {}
        limit = next((ctx[k] for k in ("le", "ge", "gt", "lt", "max_length", "min_length", "expected") if k in ctx), None)
        value = e.get("input") if e["type"] != "missing" else None
        msg = e["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{field}: {msg}" if field else msg, param=field or msg.split(":")[0], value=value,
                       limit=limit if isinstance(limit, (int, float, str)) else None) from None


def openapi30(node, defs: dict):
    """A pydantic (JSON Schema 2020-12) schema as OpenAPI 3.0 (what BentoML's ``/docs.json`` is):
    ``$ref`` to ``$defs`` inlined, ``anyOf [X, null]`` -> X + ``nullable``, numeric
    ``exclusiveMinimum`` -> ``minimum`` + ``exclusiveMinimum: true``."""
    if isinstance(node, list):
        return [openapi30(v, defs) for v in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return openapi30(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    out = {k: openapi30(v, defs) for k, v in node.items() if k not in ("$defs", "anyOf")}
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o != {"type": "null"}]
        if len(options) == 1:
            out.update(openapi30(options[0], defs))
        else:
            out["anyOf"] = openapi30(options, defs)
        if len(options) < len(node["anyOf"]):
            out["nullable"] = True
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(key), (int, float)) and not isinstance(out[key], bool):
            out[bound], out[key] = out[key], True
    return out


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": "string", "nullable": True}, "code": {"type": "string"}, "value": {}, "limit": {}}}}}


def openapi_operation(model: type[BaseModel], model_name: str, errors=(400, 401, 403, 404, 413, 429, 503)) -> dict:
    """``openapi_extra`` for a route that parses its own JSON body: the request schema and every
    error status it can answer, so the published spec is what a client (or a fuzzer) needs."""
    schema = model.model_json_schema()
    body = openapi30(schema, schema.get("$defs", {}))
    body["properties"]["model"] = {"type": "string", "enum": [model_name], "description": "the served model's name"}
    body["additionalProperties"] = False  # an unknown field is a 400 (parse_request: refuse_unknown)
    if "messages" in body["properties"]:
        body["properties"]["messages"]["items"]["additionalProperties"] = False
    reasons = {400: "invalid field (names the field, value and limit)", 401: "missing or invalid key",
               403: "forbidden", 404: "unknown model", 413: "body too large", 429: "too many requests in flight",
               503: "no variant could answer"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "the completion (JSON), or server-sent events with stream: true",
                                  "content": {"application/json": {"schema": {"type": "object"}},
                                              "text/event-stream": {"schema": {
                                                  "type": "object", "properties": {"data": {"type": "string"}}}}}},
                          **{str(s): {"description": reasons[s], "content": {"application/json": {"schema": ERROR_SCHEMA}}}
                             for s in errors}}}


ADMIN_COMMAND = {"oneOf": [
    {"type": "object", "required": ["action", "weight"], "properties": {
        "action": {"type": "string", "enum": ["set-weight"]}, "weight": {"type": "number", "minimum": 0, "maximum": 100},
        "reason": {"type": "string", "maxLength": 500}}},
    {"type": "object", "required": ["action"], "properties": {
        "action": {"type": "string", "enum": ["promote", "pause", "resume", "rollback", "restart", "analyse",
                                              "golden-canary"]},
        "reason": {"type": "string", "maxLength": 500}}}]}
