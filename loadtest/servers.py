"""Start a real ``bentoml serve`` (router with its variants, or one service) and wait until it is ready."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


# Drawn below the kernel's ephemeral range (32768-60999 by default; read from /proc where it can be): a port the
# kernel hands out for an outgoing connection or a bind to port 0 (BentoML's own variant services, vLLM's sockets, other
# tests' clients) can then never take ours between this check and the server's bind. bind(("", 0)) draws from that
# range, and in a fresh-clone CI run one server lost its port that way ("Address already in use") and never came up.
PORTS = (20000, 32767)


def port_range() -> tuple:
    """``PORTS``, ending below the kernel's ephemeral range where that starts lower (a host configured so)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return PORTS
    if low - 1 >= PORTS[0] + 1000:
        return (PORTS[0], min(PORTS[1], low - 1))
    return (1024, low - 1) if low - 1 >= 2048 else PORTS  # too little room below: the relaunch covers it


def free_port() -> int:
    """A loopback port free now, drawn at random below the ephemeral range."""
    rng = random.SystemRandom()
    ports = port_range()
    for _ in range(200):
        port = rng.randint(*ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {ports[0]}-{ports[1]} after 200 tries")


class Server:
    """``bentoml serve <target>`` on a free loopback port; subclasses change ``command`` and ``ready_path``."""

    ready_path = "/readyz"

    def __init__(self, env: dict, log: Path, target: str = "policy_bundle.serve.router.service:PolicyRouter"):
        self.log, self.target, self.env = log, target, env
        self.launch()

    def launch(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with self.log.open("w") as out:  # the child holds its own copy of the file
            self.proc = subprocess.Popen(self.command(self.target), cwd=ROOT, env={**os.environ, **self.env},
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def relaunch_if_port_lost(self, budget: list) -> bool:
        """When the server exited because another process bound its port between ``free_port()`` and its bind, start
        it again on a new port (while ``budget[0]`` > 0, which it decrements); True when it did. Callers that poll a
        server started without ``wait_ready`` call it in their loop; ``url`` and ``port`` then change."""
        if self.proc.poll() is None or budget[0] <= 0 or "Address already in use" not in self.log.read_text():
            return False
        budget[0] -= 1
        self.stop()  # whatever the dead server's group left behind
        self.launch()
        return True

    def command(self, target: str) -> list:
        return [sys.executable, "-m", "bentoml", "serve", target, "--host", "127.0.0.1", "--port", str(self.port)]

    def wait_ready(self, timeout: float = 240) -> "Server":
        deadline, relaunches = time.monotonic() + timeout, [2]
        while time.monotonic() < deadline:
            if self.relaunch_if_port_lost(relaunches):
                continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}{self.ready_path}", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
