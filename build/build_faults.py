"""The one place the build meets the test faults (``bundle.faults``, ``POLICY_BUNDLE_TEST_FAULT``), each installed
where its part is made: the mesh actors get a ``ShardFaults`` at setup (``kill``, ``hold``, ``raise``; a respawned
actor gets none), calibration's observer state passes through ``scaled`` (``scale``), the exported ONNX file through
``broken_onnx`` (``artifact:name=onnx``), and the manifest records ``spec()``. With no fault set each is a no-op."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from policy_bundle.bundle.faults import FAULT_ENV, Fault, announced_spec, apply_onnx_fault, apply_scale_fault


def spec() -> Optional[str]:
    """The active fault spec, announced once per process (stderr and log), or None: the manifest records it."""
    return announced_spec()


def raw_spec() -> str:
    """The spec as set in this process's environment ("" when none), handed to the mesh actors at setup."""
    return os.environ.get(FAULT_ENV, "")


class ShardFaults:
    """A mesh actor's faults, checked as it works through a shard (``check(shard, done)``): ``kill`` exits the process
    hard once ``done`` items are finished (rank ``rank`` or every rank), ``hold`` blocks rank ``rank`` until it is
    killed, ``raise`` fails the endpoint working on shard ``shard``. An actor of a later generation (respawned) has
    none."""

    def __init__(self, spec: str, rank: int, generation: int):
        self.fault = Fault.parse(spec) if generation == 0 else None
        self.rank = rank

    def check(self, shard: int, done: int) -> None:
        f = self.fault
        if f is None:
            return
        if f.kind == "kill" and f.rank in (-1, self.rank) and done >= f.after:
            os._exit(17)  # a hard crash: no cleanup, no reply
        if f.kind == "hold" and self.rank == f.rank:
            time.sleep(3600)  # until the test kills this process or its host
        if f.kind == "raise" and shard == f.shard:
            raise RuntimeError(f"injected fault in shard {shard}")


def scaled(state: dict) -> dict:
    """Calibration's observer state, one layer's activation range widened under ``scale`` (a broken candidate)."""
    return apply_scale_fault(state)


def broken_onnx(path: Path) -> None:
    """The exported ONNX model's weights rolled by one row under ``artifact:name=onnx`` (a broken artifact)."""
    apply_onnx_fault(path)
