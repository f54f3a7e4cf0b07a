"""``policy-bundle watch``'s state: the checks it made (``<out_root>/watch-state.json``, the newest ``MAX_CHECKS``), the
failures of the checkpoint it is on (retried until ``max_retries``), and the bundles it built (pruned to ``keep``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import List, Optional, Tuple

from policy_bundle.build.errors import BuildError
from policy_bundle.build.progress import log
from policy_bundle.bundle.manifest import read_manifest

STATE = "watch-state.json"
CHECK_FAILED = "check failed"
BUILD_FAILED = "drift, build failed"
GIVEN_UP = "given up"
MAX_CHECKS = 500  # checks kept in watch-state.json (older ones are counted in checks_dropped)


class WatchError(BuildError):
    """The monitor cannot run: a bad option, no bundle, no checkpoint directory."""


class WatchState:
    """What the monitor has done so far, saved after every check."""

    def __init__(self, opts, step_of):
        """``opts``: the monitor's WatchOptions; ``step_of(path, manifest)``: the step a bundle came from."""
        self.path = opts.out_root / STATE
        given = str(opts.bundle.resolve())
        data = None
        if self.path.is_file() and not opts.reset:
            try:
                data = json.loads(self.path.read_text())
                known = (data["origin"], data["deployed"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise WatchError(f"{self.path}: not a watch state file ({type(exc).__name__}: {exc}); "
                                 "move it away or pass --reset") from None
            if given not in known:  # another bundle's history: never overwrite it silently
                raise WatchError(f"--bundle: {self.path} follows {data['origin']} (deployed now: {data['deployed']}); "
                                 "pass one of those, another --out-root, or --reset to start over from this bundle")
        if data is None:
            step = step_of(opts.bundle, read_manifest(opts.bundle))
            data = {"origin": given, "deployed": given, "deployed_step": step, "last_step": step, "checks": []}
        self.data = data

    @property
    def deployed(self) -> Path:
        return Path(self.data["deployed"])

    def due(self, checkpoints: List[Tuple[int, Path]], every: int) -> Optional[Tuple[int, Path]]:
        """The newest checkpoint at least ``every`` steps past the last one checked (older ones are
        superseded by it), or None."""
        last = self.data["last_step"]
        ready = [c for c in checkpoints if last is None or c[0] >= last + every]
        return ready[-1] if ready else None

    def failures(self, step: int) -> int:
        return int(self.data.get("failures", {}).get(str(step), 0))

    def record(self, check: dict, max_retries: int = 5) -> None:
        """Append a check. A failed check, or a build that may pass, does not count as done: the checkpoint is tried
        again, until its ``max_retries``-th failure gives it up. The newest MAX_CHECKS checks are kept."""
        failures = self.data.setdefault("failures", {})
        retry = check["decision"] == CHECK_FAILED or (check["decision"] == BUILD_FAILED and check.get("transient"))
        if retry:
            n = failures[str(check["step"])] = self.failures(check["step"]) + 1
            check["failures"] = n
            if n >= max_retries:
                check["decision"] = f"{check['decision']}, {GIVEN_UP}"
                log(f"[watch] step {check['step']}: {GIVEN_UP} after {n} failures (--max-retries {max_retries})")
                retry = False
        if not retry:
            failures.pop(str(check["step"]), None)
            self.data["last_step"] = check["step"]
        if check.get("new_bundle"):
            self.data["deployed"], self.data["deployed_step"] = check["new_bundle"], check["step"]
            self.data.setdefault("built", []).append({k: check.get(k) for k in ("step", "new_bundle", "int8_tag",
                                                                                "fp16_tag")})
        checks = self.data["checks"]
        checks.append(check)
        if len(checks) > MAX_CHECKS:
            self.data["checks_dropped"] = self.data.get("checks_dropped", 0) + len(checks) - MAX_CHECKS
            del checks[:-MAX_CHECKS]
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        tmp.replace(self.path)


def prune(state: WatchState, keep: int) -> None:
    """Remove the bundles this monitor built beyond the newest ``keep`` (never the deployed one), from disk and from
    the model store, one line each."""
    built = state.data.get("built", [])
    old = [b for b in built[:-keep] if b["new_bundle"] != state.data["deployed"]]
    for b in old:
        shutil.rmtree(b["new_bundle"], ignore_errors=True)
        tags = [t for t in (b.get("int8_tag"), b.get("fp16_tag")) if t]
        for tag in tags:
            try:
                import bentoml

                bentoml.models.delete(tag)
            except Exception as exc:  # noqa: BLE001 - already gone, or the store unwritable: said, not fatal
                log(f"[watch] could not remove {tag} from the model store: {type(exc).__name__}: {exc}")
        log(f"[watch] removed step {b['step']}'s bundle {b['new_bundle']}" + (f" and {', '.join(tags)}" if tags else "")
            + f" (--keep {keep})")
    state.data["built"] = [b for b in built if b not in old]
    state.save()
