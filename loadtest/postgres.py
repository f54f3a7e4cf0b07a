"""A real PostgreSQL server for tests and drills: ``initdb`` + ``pg_ctl`` into a temporary directory, loopback
only, trust authentication. As root it runs as the ``postgres`` user (``initdb`` refuses root)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional

from policy_bundle.loadtest.servers import free_port


def fresh_root() -> Path:
    """A new directory under the system temp dir that the ``postgres`` user can traverse."""
    root = Path(tempfile.mkdtemp(prefix="policy-bundle-pg-"))
    root.chmod(0o755)
    return root


def pg_bindir() -> Optional[Path]:
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    return Path(dirs[-1]) if dirs else None


class PostgresServer:
    """``root`` must be reachable by the ``postgres`` user (pytest's tmp dirs are 0700 root: use ``fresh_root``)."""

    def __init__(self, root: Path):
        bindir = pg_bindir()
        if bindir is None:
            raise FileNotFoundError("PostgreSQL's initdb/pg_ctl are not installed (apt-get install postgresql)")
        self.bindir, self.root, self.port = bindir, root, free_port()
        self.data, self.sock = root / "data", root / "sock"
        root.mkdir(parents=True, exist_ok=True)
        self.sock.mkdir(exist_ok=True)
        self.as_user: List[str] = []
        if os.geteuid() == 0:
            shutil.chown(root, "postgres")
            shutil.chown(self.sock, "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        res = subprocess.run([*self.as_user, str(self.bindir / tool), *args], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{tool} failed: {res.stdout[-1500:]}{res.stderr[-1500:]}")

    def start(self) -> "PostgresServer":
        opts = f"-p {self.port} -k {self.sock} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "server.log"), "-w", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        if self.running():
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()
