"""policy-bundle: one import namespace (``policy_bundle.build``, ``.serve``, ``.quantize``, ``.bundle``,
``.loadtest``) over the repository's top-level folders.

Installed from a wheel, the folders sit inside this package (``hatch_build.py`` maps them there), so
nothing installs a top-level ``build`` or ``serve`` that would shadow another project's modules. In a
checkout (the editable install, a bento's ``src/``) this package's submodules are the folders beside
it: its search path is the repository root.
"""

from pathlib import Path as _Path

_here = _Path(__file__).resolve().parent
if not (_here / "serve").is_dir() and (_here.parent / "serve" / "__init__.py").is_file():
    __path__ = [str(_here.parent)]  # noqa: F821 - a package's search path, read by the import system
