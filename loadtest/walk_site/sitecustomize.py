"""Loaded by every Python process started with this folder on ``PYTHONPATH`` (``loadtest/walk.py --chat``): while
the file ``$POLICY_BUNDLE_WALK_DIR/on`` exists, record the source file and function of every call made in a file under
``$POLICY_BUNDLE_WALK_ROOT`` (tests, loadtest and a virtual environment there aside), in every thread; when the file goes, write them to
``$POLICY_BUNDLE_WALK_DIR/<pid>.json`` with the process's argv. Imports nothing of the project, so it measures any
version of it."""

import os

_DIR = os.environ.get("POLICY_BUNDLE_WALK_DIR")
_ROOT = os.environ.get("POLICY_BUNDLE_WALK_ROOT")

if _DIR and _ROOT:
    import json
    import sys
    import threading
    import time

    _root = os.path.realpath(_ROOT) + os.sep
    _skip = tuple(_root + d + os.sep for d in ("tests", "loadtest", ".venv", "docs"))
    _on = [False]
    _calls = []
    _flag = os.path.join(_DIR, "on")

    def _profile(frame, event, _arg):
        if event == "call" and _on[0]:
            path = frame.f_code.co_filename
            if path.startswith(_root) and not path.startswith(_skip):
                _calls.append(path[len(_root):] + ":" + frame.f_code.co_name)

    def _poll():
        while True:
            now = os.path.exists(_flag)
            if now and not _on[0]:
                _calls.clear()
                _on[0] = True
            elif _on[0] and not now:
                _on[0] = False
                tmp = os.path.join(_DIR, f".{os.getpid()}.json")
                with open(tmp, "w") as f:
                    json.dump({"argv": sys.argv, "calls": list(_calls)}, f)
                os.replace(tmp, os.path.join(_DIR, f"{os.getpid()}.json"))
            time.sleep(0.05)

    sys.setprofile(_profile)
    threading.setprofile(_profile)
    threading.Thread(target=_poll, name="walk-poll", daemon=True).start()
