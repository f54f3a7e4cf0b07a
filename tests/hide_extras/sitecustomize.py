"""Loaded at interpreter start when this folder is on PYTHONPATH (tests/test_extras.py): importing a top-level module
named in POLICY_BUNDLE_TEST_HIDE fails with ModuleNotFoundError, as in an install without the extra that provides it.
(``importlib.util.find_spec`` still finds it: torch probes optional modules that way without importing them.)"""

import importlib.abc
import importlib.machinery
import os
import sys

HIDDEN = tuple(m for m in os.environ.get("POLICY_BUNDLE_TEST_HIDE", "").split(",") if m)


class _Refused(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (hidden by the test)", name=spec.name)

    def exec_module(self, module):  # never reached: create_module raises
        raise ModuleNotFoundError(module.__name__)


class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return importlib.machinery.ModuleSpec(name, _Refused())
        return None


if HIDDEN:
    sys.meta_path.insert(0, _Hidden())
