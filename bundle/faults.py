"""Test-only fault switches (one env var), so tests can inject the failures the build must survive.

``POLICY_BUNDLE_TEST_FAULT``:
- ``kill:rank=1:after=1``: the mesh worker of rank 1 exits hard after its first batch/prompt (no ``rank``:
  every worker; respawned workers never);
- ``hold:rank=1``: the mesh worker of rank 1 blocks in its first shard until it is killed (so a test can
  kill its host while a shard is in flight);
- ``raise:shard=1``: the endpoint working on shard 1 raises;
- ``scale:layer=layers.1.mlp.down_proj:factor=50``: that layer's activation range (and so its scale)
  is multiplied by 50 after calibration, a deliberately broken INT8 candidate;
- ``slow:factor=0.3``: the served variants' generation sleeps that many seconds per token (so a test
  can have requests in flight when it stops the server);
- ``loop:name=analysis:count=2``: the router's ``analysis`` (or ``health``) loop raises on its first 2 ticks;
- ``fail:after=2[:name=int8]``: the served variants (or the one named) fail every generation after its 2nd
  token (``after=0``: before the first);
- ``novllm``: the FP16 variant's vLLM engine fails to load (as a broken install would);
- ``artifact:name=onnx``: the build's exported ONNX model gets wrong weights (every weight matrix rolled by one
  row) while it still loads and runs, a broken artifact the build must not ship;
- ``stall:after=0:factor=5[:name=int8]``: the served variants (or the one named) wait that many seconds
  before handing out token ``after`` (0: before the first), without blocking other requests; several
  stalls of one variant all apply (e.g. a slow first token and a stall mid-stream);
- ``hang:after=3[:name=int8]``: the served batched engine (or the one whose name starts with ``name``) blocks its
  decode thread for good at its ``after``-th step, while its health endpoint still answers (a hung kernel);
- ``template``: the router's chat template raises (``raise_exception``, as real templates do) on a
  system message that is not the first message;
several faults at once: separated by ``;``.

Each package reads them in one module, which installs each fault where its part is made: ``serve/serving_faults.py``
(an engine's step hook, an engine wrapper, a loop tick, a chat template) and ``build/build_faults.py`` (the mesh
actors' shard checks, the calibration state, the exported ONNX file, the manifest's record of the spec).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

FAULT_ENV = "POLICY_BUNDLE_TEST_FAULT"
KINDS = ("kill", "hold", "raise", "scale", "slow", "loop", "fail", "novllm", "artifact", "stall", "template", "hang")
_announced: set = set()


@dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    rank: int = -1
    shard: int = -1
    after: int = 0
    layer: str = ""
    factor: float = 1.0
    name: str = ""  # loop: the router's loops it hits (comma-separated); fail, stall: the variant (int8/fp16),
    # "" both; artifact: the exported artifact it breaks (onnx)
    count: int = 0  # loop: how many of its ticks raise

    @classmethod
    def parse_all(cls, spec: str) -> List["Fault"]:
        """Several faults, separated by ``;``."""
        return [cls._parse_one(s) for s in (spec or "").split(";") if s.strip()]

    @classmethod
    def parse(cls, spec: str) -> Optional["Fault"]:
        faults = cls.parse_all(spec)
        return faults[0] if faults else None

    def hits(self, name: str) -> bool:
        return not self.name or name in self.name.split(",")

    @classmethod
    def _parse_one(cls, spec: str) -> "Fault":
        kind, *fields = spec.strip().split(":")
        try:
            if kind not in KINDS or any("=" not in f for f in fields):
                raise ValueError
            kv = dict(f.split("=", 1) for f in fields)
            return cls(kind, int(kv.get("rank", -1)), int(kv.get("shard", -1)), int(kv.get("after", 0)),
                       kv.get("layer", ""), float(kv.get("factor", 1.0)), kv.get("name", ""), int(kv.get("count", 0)))
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: {spec!r} is not a fault spec (kind one of {', '.join(KINDS)}, "
                             "then :key=value fields)") from None


def fault_spec() -> Optional[str]:
    """The active fault spec (recorded in the manifest and the servers' health), or None."""
    return os.environ.get(FAULT_ENV) or None


def active_faults(kind: Optional[str] = None, name: Optional[str] = None) -> List[Fault]:
    """Every injected fault of ``kind`` that hits ``name`` (when given), announced once per process on
    stderr and in the log: a production build or server that has one set says so loudly."""
    spec = fault_spec()
    faults = Fault.parse_all(spec or "")
    if faults and spec not in _announced:
        _announced.add(spec)
        msg = f"policy-bundle: TEST FAULT ACTIVE ({FAULT_ENV}={spec}): this process is deliberately faulty"
        logging.getLogger("policy_bundle").warning(msg)
        print(msg, file=sys.stderr, flush=True)
    return [f for f in faults if (kind is None or f.kind == kind) and (name is None or f.hits(name))]


def announced_spec() -> Optional[str]:
    """The active fault spec, announced once per process (``active_faults``), or None: what a manifest or a
    router's status records."""
    active_faults()
    return fault_spec()


def active_fault(kind: Optional[str] = None, name: Optional[str] = None) -> Optional[Fault]:
    """The first injected fault of ``kind`` that hits ``name`` (see ``active_faults``), or None."""
    faults = active_faults(kind, name)
    return faults[0] if faults else None


def apply_scale_fault(state: dict) -> dict:
    """Widen one layer's input activation range by ``factor`` (only under a ``scale`` fault)."""
    fault = active_fault("scale")
    if fault is None:
        return state
    key = f"{fault.layer}.quant.activation_post_process"
    if key not in state:
        raise KeyError(f"{FAULT_ENV}: no observer {key!r}")
    lo, hi = state[key]
    return {**state, key: (lo * fault.factor, hi * fault.factor)}


def apply_onnx_fault(path: Path) -> None:
    """Roll every weight matrix of the ONNX model at ``path`` by one row (only under ``artifact:name=onnx``)."""
    if active_fault("artifact", "onnx") is None:
        return
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    for init in model.graph.initializer:
        arr = numpy_helper.to_array(init)
        if arr.ndim >= 2 and arr.shape[0] > 1:
            init.CopyFrom(numpy_helper.from_array(np.roll(arr, 1, axis=0), init.name))
    onnx.save(model, str(path))
