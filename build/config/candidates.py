"""``recipe.auto_candidates`` entries: a scheme name, optionally with recipe fields set for that candidate.

    auto_candidates: [smooth-w8a8, "w8a8 rounding=nearest", "smooth-w8a8 skip=[embed_tokens]"]

Each ``key=value`` is a ``recipe`` field (values read as YAML) that replaces the section's own value
for this candidate only; the entry itself is the candidate's name in logs, the gate report and
the manifest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Tuple

import yaml

from policy_bundle.build.errors import ConfigError
from policy_bundle.quantize.recipe_types import W8A8Recipe
from policy_bundle.quantize.recipes import SCHEMES

# The recipe fields a w8a8 candidate may set: each candidate gets its own plan from statistics shared
# by all (build/calibrate/calibrated.py). torch.ao candidates share one calibration per smoothing choice, so their
# fields (backend, reduce_range, smooth_alpha, skip) stay section-wide, as do overrides and fp32_layers.
CANDIDATE_FIELDS = ("skip", "outlier_ratio", "smooth_alphas", "rounding", "gptq_damp", "lm_head_topk",
                    "rotation_block", "vocab_rows")
_PAIR = re.compile(r"\s*(\w+)=(\[[^\]]*\]|\S+)")


@dataclass(frozen=True)
class Candidate:
    name: str  # the entry as written
    scheme: str
    fields: Tuple[Tuple[str, Any], ...] = ()  # (recipe field, value) for this candidate only


def parse_candidate(entry: str, coerce: Callable[[str, Any], Any]) -> Candidate:
    """``coerce(field, raw value)`` checks one field the way the ``recipe`` section does (type and limits)."""
    where = f"recipe.auto_candidates: {entry!r}"
    scheme, _, rest = entry.strip().partition(" ")
    if scheme not in SCHEMES:
        raise ConfigError(f"recipe.auto_candidates: {scheme!r} is not one of {list(SCHEMES)}"
                          + (f" (in {entry!r})" if rest else ""))
    fields, pos, rest = [], 0, rest.strip()
    while pos < len(rest):
        m = _PAIR.match(rest, pos)
        if m is None:
            raise ConfigError(f"{where}: expected 'scheme key=value ...', could not read {rest[pos:]!r}")
        key, raw = m.groups()
        if key not in CANDIDATE_FIELDS:
            raise ConfigError(f"{where}: {key!r} cannot be set per candidate (one of {list(CANDIDATE_FIELDS)})")
        try:
            fields.append((key, coerce(key, yaml.safe_load(raw))))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: {key}={raw} is not a YAML value ({str(exc).splitlines()[0]})") from None
        pos = m.end()
    if fields and scheme not in W8A8Recipe.schemes:
        raise ConfigError(f"{where}: fields per candidate apply to the w8a8 recipes only (torch.ao candidates "
                          f"share one calibration)")
    return Candidate(entry, scheme, tuple(fields))
