"""The floors (imports only point down) and the one installed namespace.

    quantize  <-  bundle  <-  build
                    ^
                    +------  serve          loadtest talks to serve over HTTP
"""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cli_helpers import ROOT

FOLDERS = ("quantize", "bundle", "build", "serve", "loadtest")
# what each folder may import from the project (itself always)
ALLOWED = {
    "quantize": set(),
    "bundle": {"quantize"},
    "build": {"quantize", "bundle"},
    "serve": {"quantize", "bundle"},
    "loadtest": {"quantize", "bundle", "build"},
}
GENERIC = {"build", "serve", "quantize", "loadtest", "bundle"}


def project_imports(path: Path):
    """(line, folder imported) for every import of ours in a file; a bare top-level name is an error."""
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "policy_bundle" and len(parts) > 1:
                yield node.lineno, parts[1]
            elif parts[0] in GENERIC:
                yield node.lineno, f"top-level {parts[0]}"


def test_every_import_points_down_and_through_the_namespace():
    problems = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, target in project_imports(path):
                if target.startswith("top-level"):
                    problems.append(f"{path.relative_to(ROOT)}:{line} imports {target} (use policy_bundle.*)")
                elif target != folder and target not in ALLOWED[folder]:
                    problems.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({folder} may import "
                                    f"{sorted(ALLOWED[folder]) or 'nothing of ours'})")
    assert not problems, "\n".join(problems)


def test_the_floor_check_catches_an_import_that_runs_backwards(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from policy_bundle.build.data import load_tokenizer\nimport serve.service\n")
    assert [t for _, t in project_imports(bad)] == ["build", "top-level serve"]


def test_the_wheel_installs_one_namespace(tmp_path):
    """Nothing but policy_bundle/ at the wheel's top level (no `build` or `serve` to shadow others)."""
    hatchling = Path(sys.executable).parent / "hatchling"
    if not hatchling.exists():
        pytest.fail("hatchling is part of the test extra; run ./setup.sh")
    res = subprocess.run([str(hatchling), "build", "-t", "wheel", "-d", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    wheel = next(tmp_path.glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"policy_bundle"}
    for folder in FOLDERS:
        assert f"policy_bundle/{folder}/__init__.py" in names
    assert "policy_bundle/serve/service.py" in names and "policy_bundle/build/configs/reference.yaml" in names


def test_the_environment_has_no_top_level_build_of_ours(tmp_path):
    """From outside the checkout, `build` is not our package (PyPA's `python -m build` keeps its name)."""
    code = ("import importlib.util as u, sys; s = u.find_spec('build'); "
            "print(s.origin if s else None); import policy_bundle.serve, policy_bundle.build; "
            "print(policy_bundle.build.__file__)")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    origin, ours = res.stdout.split()
    assert origin == "None" or str(ROOT) not in origin
    assert ours == str(ROOT / "build" / "__init__.py")
