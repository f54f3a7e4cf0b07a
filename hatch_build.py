"""Wheel build hook: the repository's top-level folders go into the wheel as ``policy_bundle/<folder>``.

Only the standard wheel: the editable install maps ``policy_bundle`` to ``policy_bundle/__init__.py`` in
the checkout (exact dev mode), whose search path is the checkout's root.
"""

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

FOLDERS = ("bundle", "build", "quantize", "serve", "loadtest")


class NamespaceHook(BuildHookInterface):
    def initialize(self, version, build_data):
        if self.target_name == "wheel" and version == "standard":
            for name in FOLDERS:
                build_data["force_include"][name] = f"policy_bundle/{name}"
