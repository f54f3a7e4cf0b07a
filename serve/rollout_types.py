"""What a rollout is made of: its steps, cohort match rules and settings (``RolloutConfig``, validated), the
state row one bundle pair's rollout keeps in the database, and the status and action names."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Tuple

from policy_bundle.quantize.fidelity import GateThresholds

VARIANT_NAMES = ("int8", "fp16")


@dataclass(frozen=True)
class RolloutStep:
    """INT8's traffic share at one step, and how long it stays there at least once analyses pass
    (``pause_s``); ``indefinite`` waits at this step for an operator's ``promote``."""

    weight: float
    pause_s: float = 0.0
    indefinite: bool = False


@dataclass(frozen=True)
class MatchRule:
    """Requests whose header (or cookie) ``name`` equals ``value`` go to ``variant`` (A/B by cohort)."""

    variant: str
    value: str
    header: Optional[str] = None
    cookie: Optional[str] = None


@dataclass(frozen=True)
class RolloutConfig:
    steps: Tuple[RolloutStep, ...] = tuple(RolloutStep(w) for w in (1.0, 5.0, 25.0, 50.0, 100.0))
    analysis_interval_s: float = 30.0
    sync_interval_s: float = 1.0  # how often a replica re-reads the shared state
    min_samples: int = 20  # INT8-served requests (or golden items) an analysis needs
    failure_limit: int = 2  # failed analyses in a row before rolling back to 0 %
    inconclusive_limit: int = 5  # inconclusive analyses in a row before the rollout pauses for an operator
    consecutive_error_limit: int = 4  # metric-source errors in a row (golden canary runs) before an abort
    max_error_rate: float = 0.05  # fails when even the rate's lower bound (at ``confidence``) is above it
    max_p99_latency_ratio: float = 3.0  # INT8 p99 / FP16 p99
    min_latency_samples: int = 100  # per variant before the p99 ratio is judged (p99 of fewer is their maximum)
    thresholds: Optional[GateThresholds] = None  # None: the bundle's own gate thresholds
    confidence: float = 0.95  # two-sided confidence of the bound on the shadow flip rate
    shadow_fraction: float = 0.2
    golden_interval_s: float = 60.0
    golden_items: int = 16
    auto_start: bool = True
    match: Tuple[MatchRule, ...] = ()

    def __post_init__(self) -> None:
        steps = tuple(s if isinstance(s, RolloutStep) else RolloutStep(float(s)) for s in self.steps)
        object.__setattr__(self, "steps", steps)
        if not steps:
            raise ValueError("rollout.steps: needs at least one step")
        weights = [s.weight for s in steps]
        if any(not 0 < w <= 100 for w in weights) or weights != sorted(set(weights)):
            raise ValueError(f"rollout.steps: weights {weights} must rise strictly within (0, 100]")
        if any(s.pause_s < 0 for s in steps):
            raise ValueError("rollout.steps: pause_s must be >= 0")
        for name in ("failure_limit", "inconclusive_limit", "consecutive_error_limit", "min_samples",
                     "min_latency_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}: {getattr(self, name)} must be >= 1")
        for name, lo, hi in (("max_error_rate", 0, 1), ("shadow_fraction", 0, 1), ("confidence", 0.5, 0.9999)):
            if not lo <= getattr(self, name) <= hi:
                raise ValueError(f"rollout.{name}: {getattr(self, name)} must be in [{lo}, {hi}]")
        for rule in self.match:
            if rule.variant not in VARIANT_NAMES or (rule.header is None) == (rule.cookie is None):
                raise ValueError(f"rollout.match: {rule} needs a variant in {list(VARIANT_NAMES)} and one of "
                                 "header or cookie")


# not-started | progressing | waiting (inconclusive data) | held (operator weight; analyses roll back, never
# promote) | awaiting-promote (an indefinite step; analyses roll back) | paused (hands off) | promoted |
# rolled-back (analyses failed or an operator) | aborted (weight 0 at once: an operator or a broken metric source)
@dataclass
class RolloutState:
    weight: float = 0.0  # % of traffic to INT8
    step_index: int = -1
    status: str = "not-started"
    consecutive_failures: int = 0
    consecutive_inconclusive: int = 0
    consecutive_errors: int = 0
    step_entered_at: float = 0.0
    paused_from: str = ""  # the status a pause interrupted; resume returns to it
    updated_at: float = 0.0

    @classmethod
    def from_body(cls, body: dict) -> "RolloutState":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in known})


ANALYSED = ("progressing", "waiting", "held", "awaiting-promote")
STOPPED = ("rolled-back", "aborted")
ACTIONS = ("promote", "pause", "resume", "rollback", "abort", "set-weight", "restart")
