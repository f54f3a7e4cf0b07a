"""The build's exceptions: one base class, so the CLI turns failures into exit codes by class.

A ``BuildError`` is an expected failure whose message is the whole story (the field, the value and
the limit, or what to do next): the CLI prints it as one line, without a traceback, and exits 3
(``EXIT_REFUSED``; a failed accuracy gate, ``GateError``, exits 4).
The libraries below build/ (quantize/, bundle/) cannot derive from it; their expected failures are
listed in ``expected_errors()`` and treated the same way.
"""

from __future__ import annotations


# the CLI's exit codes (``policy-bundle --help`` lists them)
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REFUSED, EXIT_GATE, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


class BuildError(Exception):
    """An expected build failure; its message names what to fix."""


class ConfigError(BuildError, ValueError):
    """A config field has the wrong type, is out of range, or is unknown."""


class UnsupportedPolicyError(BuildError, ValueError):
    """``policy.source`` is not a model the build supports (quantize's UnsupportedModelError, named)."""


class CheckpointError(BuildError, ValueError):
    """A torchtitan checkpoint cannot become a policy: no model weights, a missing shard, a tensor of the wrong shape."""


class BundleExistsError(BuildError, FileExistsError):
    """The output directory exists and --force was not given."""


class OutputNotReplaceableError(BuildError, FileExistsError):
    """``--out`` exists and is neither a bundle nor an empty directory: --force does not delete it."""


class RegistrationError(BuildError, RuntimeError):
    """The bundle is complete at --out, but registering it in the BentoML model store failed."""


class MeshError(BuildError, RuntimeError):
    """A shard failed on the mesh (its endpoint raised, timed out, or every process died)."""


class GateError(BuildError, RuntimeError):
    """The INT8 candidate failed the accuracy gate even after layer fallback."""


class ContainerizeError(BuildError, RuntimeError):
    """A ``policy-bundle containerize`` step failed; the message names the tool or input and what to do."""


class ToolMissingError(ContainerizeError):
    """A program the step runs (podman, mmdebstrap) is not on PATH."""

    def __init__(self, tool: str, package: str, purpose: str):
        super().__init__(f"{tool}: not found on PATH ({purpose}); install it, e.g. `apt-get install -y {package}`")
        self.tool = tool


def expected_errors() -> tuple[type[BaseException], ...]:
    """``BuildError`` and the expected failures of the libraries the build calls (imported here, not at
    module load, so the CLI starts without torch)."""
    from policy_bundle.bundle.manifest import BundleVerificationError
    from policy_bundle.bundle.signing import SigningKeyError
    from policy_bundle.quantize.model.policy import UnsupportedModelError
    from policy_bundle.quantize.config.schema import FieldError

    # FieldError: a field outside its limit, e.g. RecipeError, or a section built in Python with a bad value
    return (BuildError, FieldError, UnsupportedModelError, BundleVerificationError, SigningKeyError, FileNotFoundError)
