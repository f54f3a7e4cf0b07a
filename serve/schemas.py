"""HTTP payloads (OpenAI-compatible subset) and the one error shape every 4xx uses."""

from __future__ import annotations

from typing import List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_TOKENS_LIMIT = 256


class ApiError(Exception):
    """A client error: HTTP status plus the field, the value and the limit it broke."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, value=None, limit=None,
                 code: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.value, self.limit = status, message, param, value, limit
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        err = {"message": self.message, "type": self.code, "param": self.param, "code": self.code}
        if self.value is not None:
            err["value"] = self.value if isinstance(self.value, (int, float, str, bool)) else repr(self.value)[:200]
        if self.limit is not None:
            err["limit"] = self.limit
        return {"error": err}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=0, le=2**63 - 1)
    user: Optional[str] = Field(default=None, max_length=256)
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)


class CompletionRequest(_Request):
    prompt: Union[str, List[str]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=1)
    echo: bool = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Request):
    messages: List[ChatMessage] = Field(min_length=1, max_length=64)
    logprobs: bool = False
    max_completion_tokens: Optional[int] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)


def parse_request(model: type[BaseModel], data) -> BaseModel:
    """Validate a JSON body; the first problem becomes a 400 naming the field, value and limit."""
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", param=None)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        e = exc.errors()[0]
        field = ".".join(str(p) for p in e["loc"]) or None
        ctx = e.get("ctx") or {}
        limit = next((ctx[k] for k in ("le", "ge", "gt", "lt", "max_length", "min_length", "expected") if k in ctx), None)
        value = e.get("input") if e["type"] != "missing" else None
        raise ApiError(400, f"{field}: {e['msg']}", param=field, value=value,
                       limit=limit if isinstance(limit, (int, float, str)) else None) from None
