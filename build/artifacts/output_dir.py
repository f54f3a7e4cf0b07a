"""Where a build writes: which ``--out`` it may replace, its partial directory beside it, the stale
partial directories of builds that died, and the swap of a finished bundle into place.

A build writes into ``.NAME.partial-<pid>-<random>`` next to ``--out`` and renames it into place at the
very end. The owning process's id is in the name (atomic with the directory's creation), so a later
build to the same parent can tell a directory left by a killed build (its process is gone: removed)
from one a running build is still writing (left alone). A replaced bundle is first renamed aside
(``.NAME.replaced-<pid>-<random>``), so ``--out`` is never missing while a bundle existed there.

The swap is one step where the kernel can (``renameat2`` with ``RENAME_EXCHANGE``: ``--out`` is the old bundle, then
the new one, never neither). Elsewhere it is two renames, and a build killed between them leaves ``--out`` missing,
the old bundle set aside and the new one partial: the next build to that parent puts the old bundle back (one line)
before it removes what the dead build left.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, List

from policy_bundle.build.errors import BundleExistsError, OutputNotReplaceableError
from policy_bundle.bundle.layout import MANIFEST, BundleLayout
from policy_bundle.bundle.manifest import FORMAT

WORK_DIR = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|replaced)-(?P<pid>\d+)-[A-Za-z0-9_]+$")


def written_by_build(path: Path) -> bool:
    """``path`` holds a bundle.json this project's build wrote (its format and a file table)."""
    try:
        manifest = json.loads(BundleLayout(path).manifest.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict)


def check_output(out: Path, force: bool) -> None:
    """Refuse an ``--out`` that exists without ``--force``, and, with it, one that is neither a bundle
    nor an empty directory (``--force`` never deletes anything else)."""
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise BundleExistsError(f"--out: output directory {out} already exists (use --force to replace it)")
    if out.is_symlink() or not out.is_dir() or not (written_by_build(out) or not any(out.iterdir())):
        raise OutputNotReplaceableError(
            f"--out: {out} exists and is not a bundle (no {MANIFEST} written by policy-bundle build) nor an empty "
            "directory; --force replaces only those: move it away or choose another --out")


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_work_dirs(parent: Path, log: Callable[[str], None] = print) -> List[Path]:
    """Remove the partial (and set-aside) directories in ``parent`` whose owning build process is gone; a bundle set
    aside by a build killed mid-swap goes back to its place first, when nothing has taken that place since."""
    removed = []
    for p in sorted(parent.iterdir()) if parent.is_dir() else ():
        m = WORK_DIR.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and not pid_alive(int(m["pid"])):
            aside, home = p / m["name"], parent / m["name"]
            if m["kind"] == "replaced" and aside.is_dir() and not home.exists() and not home.is_symlink():
                aside.rename(home)
                log(f"restored {home}: the bundle a build (process {m['pid']}) set aside was never replaced")
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            log(f"removed {p}: left by an interrupted build (process {m['pid']} is gone)")
    return removed


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the C library,
    kernel or filesystem has no such call."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def new_partial_dir(out: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))


def move_into_place(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; a bundle (or empty directory) there is set aside first and
    removed after, so ``out`` is always either the old bundle or the new one."""
    check_output(out, force)  # again: something may have appeared at --out while the build ran
    if out.exists() and exchange(tmp, out):  # tmp now holds the old bundle
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-{os.getpid()}-", dir=out.parent))
        out.rename(old / out.name)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
