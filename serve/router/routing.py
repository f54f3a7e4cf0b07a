"""Which variant a request goes to: the rollout weight, sticky users, the admin-only forced variant."""

from __future__ import annotations

import hashlib
import random
from typing import Optional

from fastapi import Request

from policy_bundle.serve.http import check_token
from policy_bundle.serve.router.pool import VARIANTS
from policy_bundle.serve.schemas import ApiError


def sticky_bucket(salt: str, user: str) -> float:
    """A stable position in [0, 100) for a user: same user, same weight -> same variant."""
    digest = hashlib.sha256(f"{salt}:{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100.0


def choose(weight: float, salt: str, user: Optional[str]) -> str:
    """INT8 for ``weight`` % of traffic; a user keeps their variant while the weight stays."""
    pos = sticky_bucket(salt, user) if user else random.random() * 100.0
    return "int8" if pos < weight else "fp16"


def forced_variant(request: Request, admin_token: Optional[str]) -> Optional[str]:
    """The ``x-policy-variant`` header's variant; it needs the admin token (``x-admin-token``)."""
    forced = request.headers.get("x-policy-variant")
    if forced is None:
        return None
    if forced not in VARIANTS:
        raise ApiError(400, f"x-policy-variant: {forced!r} is not one of {list(VARIANTS)}", "x-policy-variant", forced)
    if not admin_token:
        raise ApiError(403, "x-policy-variant needs the admin API, which is disabled (no admin token configured)",
                       "x-policy-variant", code="permission_denied")
    if not check_token(request.headers.get("x-admin-token"), admin_token):
        raise ApiError(403, "x-policy-variant needs a valid x-admin-token header", "x-admin-token",
                       code="permission_denied")
    return forced


def matched_variant(request: Request, rules, stopped: bool) -> Optional[str]:
    """The variant of the first ``rollout.match`` rule whose header or cookie the request carries (A/B by
    cohort). A rolled-back or aborted rollout sends INT8 cohorts to FP16 too: nobody keeps a failed policy."""
    for rule in rules:
        got = request.headers.get(rule.header) if rule.header else request.cookies.get(rule.cookie)
        if got is not None and got == rule.value:
            return "fp16" if stopped else rule.variant
    return None
