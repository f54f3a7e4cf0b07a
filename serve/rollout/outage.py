"""The rollout while its database is away: a replica that started without it (FP16 only until it answers), stops
(rollback, abort, the rollback failed analyses decide) applied on this replica at once and written over the row when
the database is back, and failed analyses it could not record counted here."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace

from policy_bundle.serve.rollout.state import Event, StateConflict, StoreUnavailable
from policy_bundle.serve.rollout.types import STOPPED, RolloutState

log = logging.getLogger("policy_bundle.router")


class DatabaseOutage:
    """``RolloutController``'s part for a database that cannot be reached (its ``db``, ``pair``, ``state``,
    ``version``, ``lock``, ``local_stop``, ``offline_failures`` and ``unreachable_since``)."""

    def _reach(self) -> bool:
        """A replica that started without its database: True once it answers (its state adopted)."""
        try:
            loaded = self.db.load(self.pair)
            with self.lock:
                self._adopt(loaded)
                self.unreachable_since = None
        except StoreUnavailable:
            return False
        log.warning("the rollout database answers again: INT8 at %.1f%% (%s)", self.state.weight, self.state.status)
        if self.local_stop is not None:  # the stop stays applied here until it is written
            self.state = _stopped(self.state, self.local_stop.event, self.local_stop.ts)
        return True

    def database_status(self) -> dict:
        """What /status says of the database: reachable at the last look, and a stop not yet written."""
        return {"unreachable_since": self.unreachable_since,
                "unwritten_stop": self.local_stop.event if self.local_stop is not None else None,
                "unrecorded_failed_analyses": self.offline_failures}

    def _stop_locally(self, action: str, reason: str) -> None:
        """``rollback`` / ``abort`` applied on this replica at once, the database away; written when it is back."""
        now = time.time()
        self.local_stop = Event(now, action, self.state.weight, 0.0,
                                f"{reason} (applied at once while the rollout database was unreachable)", {},
                                self.replica)
        self.state = _stopped(self.state, action, now)
        log.warning("%s applied on this replica at once: the rollout database is unreachable; written when it is "
                    "back", action)

    def _write_local_stop(self) -> bool:
        """Write the stop applied while the database was away over whatever the row holds now (a stop is the safe
        direction; another replica's stop is kept as it is). False while the database is still away."""
        with self.lock:
            try:
                loaded = self.db.load(self.pair)
                row = RolloutState.from_body(loaded[0]) if loaded is not None else self.state
                if row.status in STOPPED:  # another replica stopped it too: its row stands
                    self.state, self.version = row, loaded[1]
                elif loaded is None:
                    stop = _stopped(row, self.local_stop.event, self.local_stop.ts)
                    if self.db.create(self.pair, asdict(stop), self.local_stop) is None:
                        return False  # created meanwhile: the next tick writes over it
                    self.state, self.version = stop, 1
                else:
                    stop = _stopped(row, self.local_stop.event, self.local_stop.ts)
                    self.version = self.db.transition(self.pair, loaded[1], asdict(stop), self.local_stop)
                    self.state = stop
            except (StoreUnavailable, StateConflict):
                return False
            log.warning("%s applied while the rollout database was away is written (version %d)",
                        self.local_stop.event, self.version)
            self.local_stop, self.offline_failures = None, 0
        self.flush()
        return True

    def _failed_offline(self, why: str) -> bool:
        """A failed analysis the database cannot record: counted here; at ``failure_limit`` in a row (with those the
        database holds) INT8 stops on this replica at once (``_stop_locally``)."""
        self.offline_failures += 1
        n = self.state.consecutive_failures + self.offline_failures
        if n >= self.cfg.failure_limit:
            self._stop_locally("rollback", f"{self.cfg.failure_limit} failed analyses: {why}")
        else:
            log.warning("failed analysis %d of %d not recorded: the rollout database is unreachable", n,
                        self.cfg.failure_limit)
        return True


def _stopped(state: RolloutState, action: str, ts: float) -> RolloutState:
    """``state`` after ``rollback`` or ``abort``: no traffic to INT8."""
    return replace(state, weight=0.0, status="rolled-back" if action == "rollback" else "aborted", step_index=-1,
                   updated_at=ts)
