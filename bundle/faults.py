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

import logging
import os
import sys
from dataclasses import dataclass
from typing import Optional

FAULT_ENV = "POLICY_BUNDLE_TEST_FAULT"
KINDS = ("kill", "raise", "scale", "slow")
_announced: set = set()


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
        try:
            if kind not in KINDS or any("=" not in f for f in fields):
                raise ValueError
            kv = dict(f.split("=", 1) for f in fields)
            return cls(kind, int(kv.get("rank", -1)), int(kv.get("shard", -1)), int(kv.get("after", 0)),
                       kv.get("layer", ""), float(kv.get("factor", 1.0)))
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: {spec!r} is not a fault spec (kind one of {', '.join(KINDS)}, "
                             "then :key=value fields)") from None


def fault_spec() -> Optional[str]:
    """The active fault spec (recorded in the manifest and the servers' health), or None."""
    return os.environ.get(FAULT_ENV) or None


def active_fault() -> Optional[Fault]:
    """The injected fault, announced once per process on stderr and in the log: a production build or
    server that has one set says so loudly."""
    spec = fault_spec()
    fault = Fault.parse(spec or "")
    if fault is not None and spec not in _announced:
        _announced.add(spec)
        msg = f"policy-bundle: TEST FAULT ACTIVE ({FAULT_ENV}={spec}): this process is deliberately faulty"
        logging.getLogger("policy_bundle").warning(msg)
        print(msg, file=sys.stderr, flush=True)
    return fault


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
