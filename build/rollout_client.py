"""``policy-bundle rollout``: operate a served rollout over the router's admin API, in the spirit of
``kubectl argo rollouts``: status, history, promote, pause, resume, abort, rollback, set-weight, restart.

The router's URL and admin token come from ``--url`` / ``--token`` or ``POLICY_BUNDLE_URL`` /
``POLICY_BUNDLE_ADMIN_TOKEN``. An answer the router refuses (a bad token, a command the state does not allow, the
database away) is one line and exit 3; a router that cannot be reached, one line and exit 1.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

from policy_bundle.build.errors import BuildError

COMMANDS = ("status", "history", "promote", "pause", "resume", "abort", "rollback", "set-weight", "restart")
DEFAULT_URL = "http://127.0.0.1:3000"


class RolloutRefused(BuildError):
    """The router answered with an error (its message is the line shown)."""


class RouterUnreachable(RuntimeError):
    """No answer from the router at the URL given."""


@dataclass(frozen=True)
class AdminClient:
    url: str
    token: str
    timeout_s: float = 60.0

    @classmethod
    def from_args(cls, url: Optional[str], token: Optional[str]) -> "AdminClient":
        token = token or os.environ.get("POLICY_BUNDLE_ADMIN_TOKEN")
        if not token:
            raise RolloutRefused("--token: the admin token is needed (or POLICY_BUNDLE_ADMIN_TOKEN)")
        return cls((url or os.environ.get("POLICY_BUNDLE_URL") or DEFAULT_URL).rstrip("/"), token)

    def _call(self, method: str, path: str, **kw) -> dict:
        import httpx

        try:
            r = httpx.request(method, f"{self.url}{path}", headers={"Authorization": f"Bearer {self.token}"},
                              timeout=self.timeout_s, **kw)
        except httpx.HTTPError as exc:
            raise RouterUnreachable(f"{self.url}: no answer ({type(exc).__name__}: {exc})") from None
        try:
            body = r.json()
        except ValueError:
            body = {}
        if r.status_code >= 400:
            msg = (body.get("error") or {}).get("message") if isinstance(body, dict) else None
            raise RolloutRefused(f"{r.status_code}: {msg or r.text[:300]}")
        return body

    def status(self) -> dict:
        return self._call("GET", "/admin/rollout")

    def history(self, limit: int) -> dict:
        return self._call("GET", "/admin/rollout/history", params={"limit": str(limit)})

    def command(self, action: str, reason: str, weight: Optional[float] = None) -> dict:
        body = {"action": action, "reason": reason, **({"weight": weight} if weight is not None else {})}
        return self._call("POST", "/admin/rollout", json=body)


def status_lines(answer: dict) -> list:
    """A rollout at a glance: the pair, the status and weight, the step, the counters that decide what comes next."""
    s, pair, cfg = answer["state"], answer.get("pair", {}), answer.get("config", {})
    steps = cfg.get("steps") or []
    step = s.get("step_index", -1)
    lines = [f"pair:    {pair.get('label') or pair.get('int8_manifest', '')[:12]}",
             f"status:  {s['status']}" + (f" (paused from {s['paused_from']})" if s.get("paused_from") else ""),
             f"weight:  {s['weight']:g} % of traffic on INT8",
             f"step:    {step + 1} of {len(steps)}" if step >= 0 and steps else "step:    -"]
    since = s.get("step_entered_at")
    if since:
        lines.append(f"at step: {time.time() - since:.0f} s")
    lines.append(f"failed analyses in a row: {s.get('consecutive_failures', 0)}, inconclusive: "
                 f"{s.get('consecutive_inconclusive', 0)}, metric-source errors: {s.get('consecutive_errors', 0)}")
    lines.append(f"state version: {answer.get('state_version')}")
    return lines


def history_lines(answer: dict) -> list:
    lines = []
    for e in answer["history"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["ts"]))
        moved = f"{e['from_weight']:g} -> {e['to_weight']:g} %" if e["from_weight"] != e["to_weight"] else \
            f"{e['to_weight']:g} %"
        lines.append(f"{when}Z  {e['event']:<18} {moved:<14} {e['reason']}")
    lines.append(f"({len(answer['history'])} of {answer.get('total', len(answer['history']))} events)")
    return lines


def run(command: str, client: AdminClient, reason: str, weight: Optional[float], limit: int) -> list:
    """The lines ``policy-bundle rollout COMMAND`` prints."""
    if command == "status":
        return status_lines(client.status())
    if command == "history":
        return history_lines(client.history(limit))
    if command == "set-weight" and weight is None:
        raise RolloutRefused("set-weight: give the INT8 weight in % (0-100)")
    answer = client.command(command, reason, weight)
    written = "" if answer.get("written", True) else " (applied on this replica; the state database is away: " \
                                                     "written when it is back)"
    return [f"{command}: done{written}"] + status_lines({**client.status(), "state": answer["state"]})
