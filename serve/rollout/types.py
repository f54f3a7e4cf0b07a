"""What a rollout is made of: its steps, cohort match rules and settings (``RolloutConfig``, validated), the
state row one bundle pair's rollout keeps in the database, and the status and action names."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Tuple

from policy_bundle.quantize.config.schema import FieldError, config_model, ranged, read_as, setting
from policy_bundle.quantize.fidelity.scores import GateThresholds

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


def _listed(path: str, value: Any) -> list:
    if not isinstance(value, (list, tuple)):
        raise FieldError(path, "must be a list")
    return list(value)


def _step(where: str, value: Any) -> RolloutStep:
    """A weight, or ``{weight: W, pause_s: S}``, or ``{weight: W, pause: indefinite}`` (waits for promote)."""
    if isinstance(value, RolloutStep):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return RolloutStep(float(value))
    if not isinstance(value, dict) or set(value) - {"weight", "pause_s", "pause"} or "weight" not in value:
        raise FieldError(where, f"{value!r} is not a weight or {{weight, pause_s | pause: indefinite}}")
    if value.get("pause", "indefinite") != "indefinite" or ("pause" in value and "pause_s" in value):
        raise FieldError(f"{where}.pause", "only 'indefinite' (or pause_s: seconds instead)")
    weight, pause_s = value["weight"], value.get("pause_s", 0.0)
    for name, v in (("weight", weight), ("pause_s", pause_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise FieldError(f"{where}.{name}", f"{v!r} is not a number")
    return RolloutStep(float(weight), float(pause_s), indefinite="pause" in value)


def _rule(where: str, value: Any) -> MatchRule:
    """``{header: NAME, value: V, variant: int8|fp16}`` or the same with ``cookie: NAME``."""
    if isinstance(value, MatchRule):
        return value
    if not isinstance(value, dict) or set(value) - {"header", "cookie", "value", "variant"}:
        raise FieldError(where, f"{value!r} is not {{header | cookie, value, variant}}")
    if not all(isinstance(value.get(k, ""), str) for k in ("header", "cookie", "value", "variant")) \
            or "value" not in value:
        raise FieldError(where, "header/cookie, value and variant must be strings")
    header = value.get("header")
    return MatchRule(value.get("variant", ""), value["value"], header.lower() if header else None, value.get("cookie"))


def read_steps(path: str, value: Any) -> Tuple[RolloutStep, ...]:
    """``steps`` as YAML writes them: a list of weights and ``{weight, pause_s | pause: indefinite}`` mappings."""
    return tuple(_step(f"{path}[{i}]", s) for i, s in enumerate(_listed(path, value)))


def read_match_rules(path: str, value: Any) -> Tuple[MatchRule, ...]:
    return tuple(_rule(f"{path}[{i}]", r) for i, r in enumerate(_listed(path, value)))


DEFAULT_STEPS = tuple(RolloutStep(w) for w in (1.0, 5.0, 25.0, 50.0, 100.0))


@config_model("rollout")
class RolloutConfig:
    """The live canary: INT8's traffic share rises step by step while analyses of its traffic pass."""

    steps: Tuple[RolloutStep, ...] = read_as(read_steps, DEFAULT_STEPS, help=(
        "INT8's share of traffic (%) at each step, rising strictly within (0, 100]: a number, or {weight, pause_s: "
        "seconds} to stay at least that long, or {weight, pause: indefinite} to wait for an operator's promote"))
    analysis_interval_s: float = ranged(30.0, 0.0, help="seconds between analyses of the current step")
    sync_interval_s: float = ranged(1.0, 0.0, help="how often a replica re-reads the shared rollout state (s)")
    min_samples: int = ranged(20, 1, help="INT8-served requests (or golden items) an analysis needs")
    failure_limit: int = ranged(2, 1, help="failed analyses in a row before rolling back to 0 %")
    inconclusive_limit: int = ranged(5, 1, help=(
        "inconclusive analyses in a row before the rollout pauses for an operator"))
    consecutive_error_limit: int = ranged(4, 1, help=(
        "metric-source errors in a row (golden canary runs) before an abort"))
    max_error_rate: float = ranged(0.05, 0.0, 1.0, help=(
        "how far INT8's error rate may exceed FP16's in a window: an analysis fails when INT8's lower bound at "
        "confidence is above FP16's upper bound by more than this (overload that fails both rolls nothing back)"))
    max_p99_latency_ratio: float = ranged(3.0, 0.0, help="the largest INT8 p99 latency over FP16's p99")
    min_latency_samples: int = ranged(100, 1, help=(
        "requests per variant before the p99 ratio is judged (the p99 of fewer: their max)"))
    thresholds: Optional[GateThresholds] = setting(None, help=(
        "the golden canary's fidelity limits; unset: the bundle's own gate thresholds"))
    confidence: float = ranged(0.95, 0.5, 0.9999, help=(
        "two-sided confidence of every bound an analysis judges: the shadow flip rate, the error rates, and the "
        "golden canary's greedy agreement and reward drop"))
    shadow_fraction: float = ranged(0.2, 0.0, 1.0, help=(
        "share of greedy client requests also sent to the other variant in the background, to compare their tokens"))
    golden_interval_s: float = ranged(60.0, 0.0, help="seconds between golden canary runs (the bundle's held-out items)")
    golden_items: int = ranged(16, 0, help=(
        "golden items (the bundle's held-out prompts and float completions) each golden canary run sends to both "
        "variants; 0 makes every run a metric-source error, so the rollout aborts after consecutive_error_limit"))
    auto_start: bool = setting(True, help="start the rollout when the router starts (false: wait for an operator)")
    match: Tuple[MatchRule, ...] = read_as(read_match_rules, (), help=(
        "cohort rules, each {header: NAME | cookie: NAME, value: V, variant: int8 | fp16}: matching requests always "
        "go to that variant"))

    def __post_init__(self) -> None:
        steps = tuple(s if isinstance(s, RolloutStep) else RolloutStep(float(s)) for s in self.steps)
        object.__setattr__(self, "steps", steps)
        if not steps:
            raise FieldError("rollout.steps", "needs at least one step")
        weights = [s.weight for s in steps]
        if any(not 0 < w <= 100 for w in weights) or weights != sorted(set(weights)):
            raise FieldError("rollout.steps", f"weights {weights} must rise strictly within (0, 100]")
        if any(s.pause_s < 0 for s in steps):
            raise FieldError("rollout.steps", "pause_s must be >= 0")
        for rule in self.match:
            if rule.variant not in VARIANT_NAMES or (rule.header is None) == (rule.cookie is None):
                raise FieldError("rollout.match", f"{rule} needs a variant in {list(VARIANT_NAMES)} and one of "
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
