"""The processes of one ``bentoml serve`` (its arbiter, the router worker, the INT8 and FP16 workers
and whatever those start) found from /proc as descendants of the server's pid, each with its role and
resident memory. Nothing outside that tree is ever picked, whatever its command line says."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

WORKER_SCRIPT = "_bentoml_impl.worker.service"  # what BentoML runs for every service worker
SERVICE_ROLES = {"policy-router": "router", "int8-policy": "int8", "fp16-policy": "fp16"}
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


@dataclass(frozen=True)
class ServerProcess:
    pid: int
    role: str  # arbiter | router | int8 | fp16 | <owner>:<comm> for a process one of those started (vLLM's engine)
    rss_mb: float


def _proc_table() -> Dict[int, Tuple[int, int]]:
    """pid -> (parent pid, resident pages) for every process, from /proc/<pid>/stat."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)", which may hold spaces
            table[int(stat.parent.name)] = (int(fields[1]), int(fields[21]))
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    return table


def _argv(pid: int) -> List[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def service_name(argv: List[str]) -> Optional[str]:
    """The ``--service-name`` of a BentoML service worker's command line; None for any other process."""
    if WORKER_SCRIPT not in argv or "--service-name" not in argv[:-1]:
        return None
    return argv[argv.index("--service-name") + 1]


def server_processes(root_pid: int) -> List[ServerProcess]:
    """``root_pid`` (the ``bentoml serve`` arbiter) and all its descendants, parents before children."""
    table = _proc_table()
    children: Dict[int, List[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    if root_pid not in table:
        return []
    found, queue = [], [(root_pid, "arbiter")]
    while queue:
        pid, role = queue.pop(0)
        found.append(ServerProcess(pid, role, table[pid][1] * PAGE_KB / 1024))
        for child in sorted(children.get(pid, [])):
            name = service_name(_argv(child))
            queue.append((child, SERVICE_ROLES.get(name, name) if name else f"{role.split(':')[0]}:{_comm(child)}"))
    return found


def tree_rss_mb(root_pid: int) -> float:
    """Resident memory of a process and all its descendants (the server and every worker), in MB."""
    return sum(p.rss_mb for p in server_processes(root_pid))
