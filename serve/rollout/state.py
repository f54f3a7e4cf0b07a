"""The rollout state database: one state row per bundle pair with a version column, and an append-only event
history, behind one SQLAlchemy URL (``sqlite:///…`` for one process, ``postgresql+psycopg://…`` for replicas).

Every transition is compare-and-set: ``UPDATE … WHERE pair = ? AND version = ?`` and its event in one
transaction, so two router replicas can never undo each other; the loser of a race gets ``StateConflict`` and
re-reads. The interface is what the controller needs and nothing more (load, create, transition, append,
history, pairs), the shape Optuna's and MLflow's storages take.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError, SQLAlchemyError

META = sa.MetaData()
STATE = sa.Table(
    "rollout_state", META,
    sa.Column("int8_manifest", sa.String(64), primary_key=True),
    sa.Column("fp16_manifest", sa.String(64), primary_key=True),
    sa.Column("label", sa.String(200), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
EVENTS = sa.Table(
    "rollout_event", META,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("int8_manifest", sa.String(64), nullable=False, index=True),
    sa.Column("fp16_manifest", sa.String(64), nullable=False),
    sa.Column("state_version", sa.Integer),  # the version a transition produced; NULL for a note
    sa.Column("replica", sa.String(100), nullable=False),
    sa.Column("ts", sa.Float, nullable=False),
    sa.Column("event", sa.String(50), nullable=False),
    sa.Column("from_weight", sa.Float, nullable=False),
    sa.Column("to_weight", sa.Float, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("metrics", sa.Text, nullable=False),
    sa.UniqueConstraint("int8_manifest", "fp16_manifest", "state_version", name="one_event_per_version"),
)


class StateConflict(RuntimeError):
    """Another replica changed the state since it was read: re-read, then decide again."""


class StoreUnavailable(RuntimeError):
    """The state database cannot be reached (or refused the write); nothing was changed."""


@dataclass(frozen=True)
class BundlePair:
    """The two store entries a router serves: both from one build, so one manifest sha256."""

    int8_manifest: str
    fp16_manifest: str
    label: str = ""

    def key(self) -> dict:
        return {"int8_manifest": self.int8_manifest, "fp16_manifest": self.fp16_manifest}


@dataclass
class Event:
    ts: float
    event: str
    from_weight: float
    to_weight: float
    reason: str
    metrics: dict
    replica: str = ""
    state_version: Optional[int] = None


def default_url(state_dir: Path) -> str:
    return f"sqlite:///{Path(state_dir) / 'rollout.sqlite'}"


def _engine(url: str) -> sa.Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @sa.event.listens_for(engine, "connect")
        def _wal(conn, _record):  # readers never wait for the writer; a transition's first statement writes
            conn.execute("PRAGMA journal_mode=WAL")

        return engine
    return sa.create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=2, pool_timeout=10,
                            connect_args={"connect_timeout": 5})


class RolloutDatabase:
    """State and history of every bundle pair this database has seen."""

    def __init__(self, url: str, replica: str = ""):
        """Connects lazily: a database that cannot be reached yet is a ``StoreUnavailable`` of the first call (its
        tables are created then), not of the constructor, so a router can start without it (FP16 only)."""
        self.url, self.replica = url, replica
        with _Guard(url):
            self.engine = _engine(url)
        self.tables = False

    def _guard(self):
        if not self.tables:
            with _Guard(self.url):
                try:
                    META.create_all(self.engine)
                except (IntegrityError, ProgrammingError):  # another replica created the tables at the same moment
                    META.create_all(self.engine)
            self.tables = True
        return _Guard(self.url)

    def load(self, pair: BundlePair) -> Optional[Tuple[dict, int]]:
        """(state body, version) of the pair, or None when it has no rollout yet."""
        with self._guard(), self.engine.connect() as conn:
            row = conn.execute(sa.select(STATE.c.body, STATE.c.version).where(*_match(STATE, pair))).first()
        return (json.loads(row.body), row.version) if row else None

    def create(self, pair: BundlePair, body: dict, event: Event) -> Optional[int]:
        """The pair's first state (version 1) and its event; None when another replica created it first."""
        try:
            with self._guard(), self.engine.begin() as conn:
                conn.execute(STATE.insert().values(**pair.key(), label=pair.label, version=1, body=json.dumps(body),
                                                   created_at=event.ts, updated_at=event.ts))
                self._insert_event(conn, pair, event, 1)
        except IntegrityError:
            return None
        return 1

    def transition(self, pair: BundlePair, expected: int, body: dict, event: Event) -> int:
        """Compare-and-set: the new state and its event, only if the state is still at ``expected``."""
        try:
            with self._guard(), self.engine.begin() as conn:
                done = conn.execute(STATE.update().where(*_match(STATE, pair), STATE.c.version == expected).values(
                    version=expected + 1, body=json.dumps(body), updated_at=event.ts))
                if done.rowcount != 1:
                    raise StateConflict(f"rollout state of {pair.label or pair.int8_manifest[:12]} moved past "
                                        f"version {expected}")
                self._insert_event(conn, pair, event, expected + 1)
        except IntegrityError:
            raise StateConflict(f"version {expected + 1} was written by another replica") from None
        return expected + 1

    def append(self, pair: BundlePair, events: List[Event]) -> None:
        """Notes (no state change), in one transaction."""
        with self._guard(), self.engine.begin() as conn:
            for e in events:
                self._insert_event(conn, pair, e, None)

    def _insert_event(self, conn, pair: BundlePair, e: Event, version: Optional[int]) -> None:
        conn.execute(EVENTS.insert().values(**pair.key(), state_version=version, replica=e.replica or self.replica,
                                            ts=e.ts, event=e.event, from_weight=e.from_weight, to_weight=e.to_weight,
                                            reason=e.reason[:2000], metrics=json.dumps(e.metrics, default=str)))

    def history(self, pair: BundlePair, limit: int = 1000) -> List[Event]:
        """The pair's newest ``limit`` events, oldest first."""
        with self._guard(), self.engine.connect() as conn:
            rows = conn.execute(sa.select(EVENTS).where(*_match(EVENTS, pair)).order_by(EVENTS.c.id.desc())
                                .limit(limit)).all()
        return [Event(r.ts, r.event, r.from_weight, r.to_weight, r.reason, json.loads(r.metrics), r.replica,
                      r.state_version) for r in reversed(rows)]

    def count(self, pair: BundlePair) -> int:
        with self._guard(), self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(EVENTS).where(*_match(EVENTS, pair))).scalar()

    def pairs(self) -> List[dict]:
        """Every pair with a rollout, newest first: the previous pairs' state and history stay readable."""
        with self._guard(), self.engine.connect() as conn:
            rows = conn.execute(sa.select(STATE).order_by(STATE.c.created_at.desc())).all()
        return [{"int8_manifest": r.int8_manifest, "fp16_manifest": r.fp16_manifest, "label": r.label,
                 "version": r.version, "state": json.loads(r.body), "created_at": r.created_at} for r in rows]

    def close(self) -> None:
        self.engine.dispose()


def _match(table: sa.Table, pair: BundlePair) -> tuple:
    return table.c.int8_manifest == pair.int8_manifest, table.c.fp16_manifest == pair.fp16_manifest


class _Guard:
    """Database errors (a server down, a lock timeout) as ``StoreUnavailable`` with one line; conflicts pass."""

    def __init__(self, url: str):
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None and isinstance(exc, (OperationalError, SQLAlchemyError)) \
                and not isinstance(exc, IntegrityError):
            where = self.url.split("@")[-1]  # never the password
            raise StoreUnavailable(f"rollout state database {where}: {str(exc).splitlines()[0][:200]}") from None
        return False


def event_dict(e: Event) -> dict:
    return asdict(e)
