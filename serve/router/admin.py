"""Admin commands as a pydantic model (validated like every other body), and their execution; the history
endpoint's query parameters."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policy_bundle.serve.rollout.types import ACTIONS as ROLLOUT_ACTIONS
from policy_bundle.serve.rollout.state import BundlePair, StateConflict, StoreUnavailable
from policy_bundle.serve.schemas import ApiError, openapi30, parse_request

ACTIONS = (*ROLLOUT_ACTIONS, "analyse", "golden-canary")


class AdminCommand(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: Literal[ACTIONS]  # type: ignore[valid-type]
    weight: Optional[float] = Field(default=None, ge=0, le=100, strict=True)
    reason: str = Field(default="operator", max_length=500)

    @model_validator(mode="after")
    def _weight_with_set_weight(self):
        if (self.action == "set-weight") != (self.weight is not None):
            raise ValueError("weight: required with set-weight, and only with it")
        return self


def admin_schema() -> dict:
    schema = AdminCommand.model_json_schema()
    return openapi30(schema, schema.get("$defs", {}))


async def execute(body, canary, controller, metrics) -> dict:
    """Run one command; ApiError (400 / 503) for what cannot be done."""
    cmd = parse_request(AdminCommand, body)
    if cmd.action == "analyse":
        try:
            return await asyncio.to_thread(canary.analyse_now)
        except StoreUnavailable as exc:
            raise ApiError(503, str(exc), code="service_unavailable") from None
    if cmd.action == "golden-canary":
        try:
            run = await canary.run_golden()
        except Exception as exc:  # noqa: BLE001 - report, don't 500
            raise ApiError(503, f"golden canary run failed: {type(exc).__name__}: {exc}"[:300],
                           code="service_unavailable") from None
        return {"golden": run, "window_golden": canary.record_golden(run)}
    try:
        state = await asyncio.to_thread(controller.command, cmd.action, cmd.weight, cmd.reason)
    except (StoreUnavailable, StateConflict) as exc:  # nothing changed: the operator may retry
        raise ApiError(503, f"{cmd.action}: {exc}", code="service_unavailable", headers={"Retry-After": "1"}) from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "action") from None
    canary.new_window()
    metrics.set_rollout(state)
    # False: a stop applied on this replica while the database is away (written when it is back)
    return {"state": asdict(state), "written": controller.local_stop is None}


MAX_HISTORY = 10000


def history_limit(raw: str) -> int:
    """``?limit=`` of the history endpoint: ASCII digits in [1, MAX_HISTORY] ("²".isdigit() is true too)."""
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_HISTORY:
        raise ApiError(400, f"limit: must be an integer in [1, {MAX_HISTORY}]", "limit", raw, MAX_HISTORY)
    return int(raw)


def pair_named(db, current: BundlePair, sha: Optional[str]) -> BundlePair:
    """``?pair=<int8 manifest sha256>``: the current pair (no value, or its sha) or an earlier one the database has."""
    if sha is None or sha == current.int8_manifest:
        return current
    for p in db.pairs():
        if p["int8_manifest"] == sha:
            return BundlePair(p["int8_manifest"], p["fp16_manifest"], p["label"])
    raise ApiError(404, "pair: no rollout for that INT8 manifest sha256 (see /admin/rollout/pairs)", "pair",
                   sha[:64], code="not_found")
