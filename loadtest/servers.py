"""Start a real ``bentoml serve`` (router with its variants, or one service) and wait until it is ready."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``bentoml serve <target>`` on a free loopback port; subclasses change ``command`` and ``ready_path``."""

    ready_path = "/readyz"

    def __init__(self, env: dict, log: Path, target: str = "policy_bundle.serve.service:PolicyRouter"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(self.command(target), cwd=ROOT, env={**os.environ, **env}, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def command(self, target: str) -> list:
        return [sys.executable, "-m", "bentoml", "serve", target, "--host", "127.0.0.1", "--port", str(self.port)]

    def wait_ready(self, timeout: float = 240) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
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
