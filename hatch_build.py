"""Wheel build hook: the repository's top-level folders go into the wheel as ``policy_bundle/<folder>``.

Only the standard wheel: the editable install maps ``policy_bundle`` to ``policy_bundle/__init__.py`` in
the checkout (exact dev mode), whose search path is the checkout's root.
"""

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

FOLDERS = ("bundle", "build", "quantize", "serve", "loadtest")


class NamespaceHook(BuildHookInterface):
    def initialize(self, version, build_data):
        if self.target_name != "wheel" or version != "standard":
            return
        root = Path(self.root)
        for name in FOLDERS:
            for path in sorted((root / name).rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                    build_data["force_include"][str(path)] = f"policy_bundle/{path.relative_to(root).as_posix()}"
