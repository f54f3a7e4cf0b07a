"""Admin commands as a pydantic model (validated like every other body), and their execution."""

from __future__ import annotations

from dataclasses import asdict
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policy_bundle.serve.schemas import ApiError, openapi30, parse_request

ACTIONS = ("promote", "pause", "resume", "rollback", "set-weight", "restart", "analyse", "golden-canary")


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
        return canary.analyse_now()
    if cmd.action == "golden-canary":
        try:
            canary.window.golden = await canary.run_golden()
        except Exception as exc:  # noqa: BLE001 - report, don't 500
            raise ApiError(503, f"golden canary run failed: {type(exc).__name__}: {exc}"[:300],
                           code="service_unavailable") from None
        return {"golden": canary.window.golden}
    try:
        state = controller.command(cmd.action, cmd.weight, cmd.reason)
    except ValueError as exc:
        raise ApiError(400, str(exc), "action") from None
    metrics.weight.set(state.weight)
    return {"state": asdict(state)}
