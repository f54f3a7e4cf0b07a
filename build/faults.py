"""Test-only fault switches (one env var), so tests can inject the failures the build must survive.

``POLICY_BUNDLE_TEST_FAULT``:
- ``kill:rank=1:after=1``: the mesh worker of rank 1 exits hard after its first batch/prompt;
- ``raise:shard=1``: the endpoint working on shard 1 raises;
- ``scale:layer=layers.1.mlp.down_proj:factor=50``: that layer's activation range (and so its scale)
  is multiplied by 50 after calibration, a deliberately broken INT8 candidate;
- ``slow:factor=0.3``: the served variants' generation sleeps that many seconds per token (so a test
  can have requests in flight when it stops the server).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

FAULT_ENV = "POLICY_BUNDLE_TEST_FAULT"


@dataclass(frozen=True)
class Fault:
    kind: str  # kill | raise | scale | slow
    rank: int = -1
    shard: int = -1
    after: int = 0
    layer: str = ""
    factor: float = 1.0

    @classmethod
    def parse(cls, spec: str) -> Optional["Fault"]:
        if not spec:
            return None
        kind, *fields = spec.split(":")
        kv = dict(f.split("=", 1) for f in fields)
        return cls(kind, int(kv.get("rank", -1)), int(kv.get("shard", -1)), int(kv.get("after", 0)),
                   kv.get("layer", ""), float(kv.get("factor", 1.0)))


def active_fault() -> Optional[Fault]:
    return Fault.parse(os.environ.get(FAULT_ENV, ""))


def apply_scale_fault(state: dict) -> dict:
    """Widen one layer's input activation range by ``factor`` (only under a ``scale`` fault)."""
    fault = active_fault()
    if fault is None or fault.kind != "scale":
        return state
    key = f"{fault.layer}.quant.activation_post_process"
    if key not in state:
        raise KeyError(f"{FAULT_ENV}: no observer {key!r}")
    lo, hi = state[key]
    return {**state, key: (lo * fault.factor, hi * fault.factor)}
