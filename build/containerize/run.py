"""Run one external step (mmdebstrap, podman, bentoml) with its output streamed and a line at least every 25 s."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from policy_bundle.build.errors import ContainerizeError, ToolMissingError
from policy_bundle.build.progress import heartbeat, log

TAIL_LINES = 30  # what a failed step's error shows of its output


def require_tool(tool: str, package: str, purpose: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise ToolMissingError(tool, package, purpose)
    return path


def run_step(cmd: Sequence[str], what: str, env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None,
             echo: bool = True) -> List[str]:
    """Run ``cmd``; each output line goes to stderr (``echo``) as it comes. Returns the output lines; a non-zero
    exit raises ``ContainerizeError`` (one line; the output, or its last lines, are on stderr already)."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, **(env or {})}, cwd=cwd)
    lines: List[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if echo:
                log(f"  {lines[-1]}")

    with heartbeat():
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        rc = proc.wait()
        reader.join(timeout=10)
    if rc != 0:
        if not echo:
            for line in lines[-TAIL_LINES:]:
                log(f"  {line}")
        raise ContainerizeError(f"{what} exited with {rc} (its output is above)")
    return lines
