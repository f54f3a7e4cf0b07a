"""Per-stage progress lines with counts and timings, and progress bars when attached to a terminal."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

HEARTBEAT_S = 25.0  # a line at least this often, whatever the build is busy with


class _Now:
    """What the build is doing (stage, status) and when it last printed, for the heartbeat."""

    stage = ""
    status = ""
    stage_t0 = last_line = time.monotonic()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
    _Now.last_line = time.monotonic()


def set_status(text: str) -> None:
    """The current step inside a stage (candidate, layers done / total, best so far), for the heartbeat."""
    _Now.status = text


def heartbeat_line() -> str:
    return f"{_Now.stage} ({time.monotonic() - _Now.stage_t0:.0f}s in)" + (f": {_Now.status}" if _Now.status else "")


@contextmanager
def heartbeat(every: float = HEARTBEAT_S) -> Iterator[None]:
    """Prints ``heartbeat_line()`` whenever nothing was printed for ``every`` seconds (a long matmul,
    a mesh call, a TorchScript export), so a build never goes quiet."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(min(every, max(0.05, every - (time.monotonic() - _Now.last_line)))):
            if time.monotonic() - _Now.last_line >= every:
                log(f"[progress] {heartbeat_line()}")

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


class Stages:
    """``with stages.run("calibrate") as s: ...; s.detail = "256 samples"`` prints one line per stage."""

    def __init__(self, total: int):
        self.total, self.index, self.t0 = total, 0, time.monotonic()

    @contextmanager
    def run(self, name: str) -> Iterator["StageLine"]:
        self.index += 1
        line = StageLine()
        log(f"[{self.index}/{self.total}] {name} ...")
        t = time.monotonic()
        _Now.stage, _Now.status, _Now.stage_t0 = f"[{self.index}/{self.total}] {name}", "", t
        yield line
        extra = f" ({line.detail})" if line.detail else ""
        log(f"[{self.index}/{self.total}] {name} done in {time.monotonic() - t:.1f}s{extra}")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


class StageLine:
    detail: Optional[str] = None


def bar(total: int, desc: str, unit: str = "it"):
    """A tqdm bar on a terminal; silent otherwise (the stage line still reports counts)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=None, file=sys.stderr, leave=False)


class Throttled:
    """Calls ``log`` at most once per ``every`` seconds (and on the last item): long loops stay visible
    without flooding the output."""

    def __init__(self, every: float = 20.0):
        self.every, self.last, self.t0 = every, time.monotonic(), time.monotonic()

    def __call__(self, done: int, total: int, msg: str) -> None:
        now = time.monotonic()
        if now - self.last >= self.every or done == total:
            self.last = now
            rate = done / max(1e-9, now - self.t0)
            eta = f", ETA {(total - done) / rate:.0f}s" if 0 < done < total else ""
            log(f"{msg} ({done}/{total}, {rate:.2f}/s{eta})")
