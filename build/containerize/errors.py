"""Why a containerize step cannot go on: a missing tool, no bento, a failed build step (one CLI line each)."""

from __future__ import annotations

from policy_bundle.build.errors import BuildError


class ContainerizeError(BuildError, RuntimeError):
    """A containerize step failed; the message names the tool or input and what to do."""


class ToolMissingError(ContainerizeError):
    """A program the step runs (podman, mmdebstrap) is not on PATH."""

    def __init__(self, tool: str, package: str, purpose: str):
        super().__init__(f"{tool}: not found on PATH ({purpose}); install it, e.g. `apt-get install -y {package}`")
        self.tool = tool
