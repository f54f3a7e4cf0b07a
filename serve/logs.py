"""The service's logs: one JSON object per line (``log_format: json``, the default; ``text`` for people at a
terminal), each with the request id of the request it is about. The router takes a client's ``x-request-id`` (or
makes one), returns it on every answer, hands it to the variant that serves the request, and both log it, so one
request's lines are found across processes."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid
from typing import Optional

REQUEST_ID: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("policy_bundle_request_id", default=None)
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
FIELDS = ("variant", "status", "seconds", "tokens", "endpoint", "choices")  # extras a line may carry


def request_id(given: Optional[str]) -> str:
    """The client's ``x-request-id`` when it is a plain token of at most 128 characters, else a new one."""
    return given if given and _VALID.fullmatch(given) else uuid.uuid4().hex


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", "request_id"?, <extras>?, "exc"?}``, one line."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 3), "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
                "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        if rid:
            line["request_id"] = rid
        for key in FIELDS:
            if hasattr(record, key):
                line[key] = getattr(record, key)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        return f"{text} [request_id={rid}]" if rid else text


def configure(log_format: str) -> None:
    """Our loggers (``policy_bundle.*``) write to stderr in ``log_format``, once per process (BentoML's own logs keep
    its format)."""
    root = logging.getLogger("policy_bundle")
    if getattr(root, "_policy_bundle_configured", None) == log_format:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else
                         TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False
    root._policy_bundle_configured = log_format
