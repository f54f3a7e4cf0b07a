"""The floors (imports only point down), inside build/ too, no two modules of one name, and the one
installed namespace.

    quantize  <-  bundle  <-  build
                    ^
                    +------  serve          loadtest talks to serve over HTTP

    build/:  config <- source <- calibrate <- gate <- artifacts <- pipeline <- watch <- cli
             (errors and progress below all of them; containerize beside config, for the CLI)
    quantize/: config, percentile, extras <- model <- runtime <- calibration <- recipes <- recipe_types <- fidelity
             <- w8a8 <- export <- reference
    serve/:  rollout <- settings, model_entries;  schemas <- http;  wire, logs
             <- variants (the variant workers) <- router (the router process)
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
# the one exception to "loadtest talks to serve over HTTP": benchmarks of the variant engine's batching and of the
# router's detokenizer measure code below any HTTP surface, in process (docs/contributing.md)
IN_PROCESS_BENCHMARKS = {"loadtest/bench_batching.py", "loadtest/bench_detok.py"}
EXAMPLES = "docs/examples"  # scripts outside the package; they may import what loadtest may
# inside build/: what each unit (a stage sub-package, or a top-level module) may import of build/ (itself always)
BASE = {"errors", "progress", "build_faults"}  # build_faults: the test faults' one seam in the build
BUILD_ALLOWED = {
    "__init__": set(),
    "errors": set(),
    "progress": set(),
    "build_faults": set(),
    "config": BASE,
    "containerize": BASE,
    "rollout_client": BASE,  # the admin API over HTTP: no stage, no serve/
    "source": BASE | {"config"},
    "calibrate": BASE | {"config", "source"},
    "gate": BASE | {"config", "source", "calibrate"},
    "artifacts": BASE | {"config", "source", "calibrate", "gate"},
    "pipeline": BASE | {"config", "source", "calibrate", "gate", "artifacts"},
    "watch": BASE | {"config", "source", "calibrate", "gate", "artifacts", "containerize", "pipeline"},
    "cli": BASE | {"config", "source", "calibrate", "gate", "artifacts", "containerize", "pipeline", "watch",
                   "rollout_client"},
}
# inside serve/: by the process a unit runs in. rollout/ (the control plane's state machine and store) sits at the
# bottom, the modules both processes share above it, the variant workers above those, the router on top.
SERVE_SHARED = {"schemas", "wire", "logs", "http", "settings", "model_entries", "serving_faults"}
SERVE_ALLOWED = {
    "__init__": set(),
    "rollout": set(),
    "schemas": set(),
    "wire": set(),
    "logs": set(),
    "serving_faults": set(),  # the test faults' one seam (bundle/faults.py) in the serving processes
    "http": {"schemas"},
    "settings": {"rollout"},
    "model_entries": {"rollout"},
    "variants": SERVE_SHARED | {"rollout"},
    "router": SERVE_SHARED | {"rollout", "variants"},
}
# inside quantize/: each layer may import the layers before it. The model is plain torch; the runtime runs it (decode
# loop, slots, kernels, the TorchScript and vLLM runners); calibration measures it; fidelity compares two policies;
# the w8a8 scheme uses all of them; export writes what w8a8 made and the front (``quantize``) dispatches a recipe to its
# family; the embedded reference policy sits on top.
QUANTIZE_LAYERS = [{"__init__", "config", "percentile", "extras"}, {"model"}, {"runtime"}, {"calibration"},
                   {"recipes"}, {"recipe_types"}, {"fidelity"}, {"w8a8"}, {"export", "front"},
                   {"reference"}]
QUANTIZE_ALLOWED = {unit: set().union(*QUANTIZE_LAYERS[:i]) for i, layer in enumerate(QUANTIZE_LAYERS) for unit in
layer}
NAMED_ONCE = ("quantize", "bundle", "build", "serve")  # no two modules of these share a file name


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


def build_imports(path: Path, package: str = "build"):
    """(line, unit of ``package`` imported) for every import of ``policy_bundle.<package>.<unit>...`` in a file (a
    unit: a sub-package or a top-level module; ``from policy_bundle.<package> import x`` names ``x``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] if node.module != f"policy_bundle.{package}" else \
                [f"policy_bundle.{package}.{a.name}" for a in node.names]
        else:
            continue
        for name in modules:
            parts = name.split(".")
            if parts[:2] == ["policy_bundle", package] and len(parts) > 2:
                yield node.lineno, parts[2]


def build_unit(path: Path, package: str = "build") -> str:
    """The unit of ``package`` a file belongs to: its sub-package, or its own name at the package's top."""
    rel = path.relative_to(ROOT / package)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def build_floor_problems(path: Path, unit: str, package: str = "build", allowed: dict = BUILD_ALLOWED) -> list:
    """What ``path``, a file of ``unit``, imports of ``package`` that its floor does not allow."""
    if unit not in allowed:
        return [f"{path.name}: {package}/{unit} has no floor (give the new unit its floor in tests/test_floors.py)"]
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f"{shown}:{line} imports {package}.{target} ({package}/{unit} may import "
            f"{sorted(allowed[unit]) or f'nothing of {package}/'})"
            for line, target in build_imports(path, package) if target != unit and target not in allowed[unit]]


def same_named_modules(folders) -> dict:
    """File name -> the modules of that name under ``folders`` (``__init__.py`` aside), for names used twice."""
    seen: dict = {}
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.py")):
            if path.name != "__init__.py" and "__pycache__" not in path.parts:
                seen.setdefault(path.name, []).append(path)
    return {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_every_import_points_down_and_through_the_namespace():
    problems = []
    checked = {**ALLOWED, EXAMPLES: ALLOWED["loadtest"]}
    for folder, allowed in checked.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, target in project_imports(path):
                if target == "serve" and rel in IN_PROCESS_BENCHMARKS:
                    continue
                if target.startswith("top-level"):
                    problems.append(f"{path.relative_to(ROOT)}:{line} imports {target} (use policy_bundle.*)")
                elif target != folder and target not in allowed:
                    problems.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({folder} may import "
                                    f"{sorted(allowed) or 'nothing of ours'})")
    assert not problems, "\n".join(problems)


def test_the_floor_check_catches_an_import_that_runs_backwards(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from policy_bundle.build.calibrate.samples import local_samples\nimport serve.router.service\n")
    assert [t for _, t in project_imports(bad)] == ["build", "top-level serve"]


INNER_FLOORS = {
    # config <- source <- calibrate <- gate <- artifacts <- pipeline <- watch <- cli; no stage sub-package imports
    # build.pipeline or build.cli (watch drives the pipeline and may import it)
    "build": (BUILD_ALLOWED, {"config", "source", "calibrate", "gate", "artifacts", "watch"}),
    # rollout <- the shared modules <- variants <- router: a variant worker never imports the router's code, the
    # rollout control plane imports nothing of the serving processes
    "serve": (SERVE_ALLOWED, {"router", "variants", "rollout", "settings", "wire"}),
    "quantize": (QUANTIZE_ALLOWED, {"model", "runtime", "calibration", "fidelity", "w8a8", "export", "reference"}),
}


@pytest.mark.parametrize("package", sorted(INNER_FLOORS))
def test_inside_each_package_every_import_points_down(package):
    allowed, expected_units = INNER_FLOORS[package]
    paths = sorted((ROOT / package).rglob("*.py"))
    assert {build_unit(p, package) for p in paths} >= expected_units
    problems = [msg for path in paths for msg in build_floor_problems(path, build_unit(path, package), package, allowed)]
    assert not problems, "\n".join(problems)


def test_the_build_floor_check_catches_a_stage_that_imports_a_later_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from policy_bundle.build.calibrate.mesh import shard\n"
                   "from policy_bundle.build import gate\n")
    assert [t for _, t in build_imports(bad)] == ["calibrate", "gate"]
    assert len(build_floor_problems(bad, "config")) == 2  # config sits below both
    assert len(build_floor_problems(bad, "source")) == 2
    assert len(build_floor_problems(bad, "calibrate")) == 1  # its own unit is allowed, gate is not
    assert build_floor_problems(bad, "artifacts") == []


def test_the_build_floor_check_catches_a_stage_that_imports_the_pipeline_or_the_cli(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def later():\n    from policy_bundle.build.pipeline import run_build\n")
    for unit in ("config", "source", "calibrate", "gate", "artifacts", "containerize"):
        assert len(build_floor_problems(bad, unit)) == 1, unit
    assert build_floor_problems(bad, "watch") == []
    bad.write_text("import policy_bundle.build.cli\n")
    assert len(build_floor_problems(bad, "watch")) == 1 and build_floor_problems(bad, "cli") == []
    assert "has no floor" in build_floor_problems(bad, "newstage")[0]


def test_the_serve_floor_check_catches_a_variant_that_imports_the_router(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from policy_bundle.serve.router.pool import VariantPool\nfrom policy_bundle.serve import wire\n")
    assert [t for _, t in build_imports(bad, "serve")] == ["router", "wire"]
    assert len(build_floor_problems(bad, "variants", "serve", SERVE_ALLOWED)) == 1
    assert len(build_floor_problems(bad, "rollout", "serve", SERVE_ALLOWED)) == 2
    assert build_floor_problems(bad, "router", "serve", SERVE_ALLOWED) == []


def test_the_quantize_floor_check_catches_the_model_importing_the_runtime(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from policy_bundle.quantize.runtime.decode import greedy_generate\n")
    assert len(build_floor_problems(bad, "model", "quantize", QUANTIZE_ALLOWED)) == 1
    assert build_floor_problems(bad, "calibration", "quantize", QUANTIZE_ALLOWED) == []


def module_graph(folder: Path, package: str) -> dict:
    """Module -> the modules of ``package`` (the folder ``folder``) it imports, wherever the import stands
    (module level, inside a function, under TYPE_CHECKING)."""
    modules = {package + "." + ".".join(p.relative_to(folder).with_suffix("").parts): p
               for p in folder.rglob("*.py") if p.name != "__init__.py"}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = sorted(t for t in targets if t in modules and t != name)
    return graph


def import_cycle(graph: dict) -> list:
    """One cycle of ``graph`` as [a, b, ..., a], or [] when it has none."""
    state: dict = {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                return trail[trail.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, trail + [nxt])):
                return found
        state[node] = "done"
        return []

    return next((c for n in sorted(graph) if n not in state and (c := visit(n, [n]))), [])


def fault_readers(root: Path) -> list:
    """The modules under ``root`` that import ``policy_bundle.bundle.faults`` (the test-fault switches)."""
    readers = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(m == "policy_bundle.bundle.faults" for m in modules) or (
                    isinstance(node, ast.ImportFrom) and node.module == "policy_bundle.bundle"
                    and any(a.name == "faults" for a in node.names)):
                readers.append(str(path.relative_to(root)))
                break
    return readers


@pytest.mark.parametrize("package,seam", [("serve", "serving_faults.py"), ("build", "build_faults.py")])
def test_the_test_faults_are_read_only_through_each_package_seam(package, seam):
    """serve/serving_faults.py and build/build_faults.py install each test fault where its part is made; no request path,
    engine or stage reads them."""
    assert fault_readers(ROOT / package) == [seam]


def test_the_fault_seam_check_catches_an_engine_reading_a_fault(tmp_path):
    (tmp_path / "serving_faults.py").write_text("from policy_bundle.bundle.faults import active_fault\n")
    (tmp_path / "engine.py").write_text("def step():\n    from policy_bundle.bundle import faults\n")
    assert fault_readers(tmp_path) == ["engine.py", "serving_faults.py"]


def test_no_package_has_an_import_cycle():
    for folder in ("build", "bundle", "serve", "quantize"):
        cycle = import_cycle(module_graph(ROOT / folder, f"policy_bundle.{folder}"))
        assert not cycle, " -> ".join(cycle)


def test_the_cycle_check_catches_two_modules_that_import_each_other(tmp_path):
    (tmp_path / "a.py").write_text("from policy_bundle.pkg.b import later\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from policy_bundle.pkg import c\n")
    (tmp_path / "c.py").write_text("def f():\n    from policy_bundle.pkg.a import g\n")
    graph = module_graph(tmp_path, "policy_bundle.pkg")
    assert graph["policy_bundle.pkg.b"] == ["policy_bundle.pkg.c"]
    assert import_cycle(graph) == ["policy_bundle.pkg.a", "policy_bundle.pkg.b", "policy_bundle.pkg.c",
                                   "policy_bundle.pkg.a"]
    (tmp_path / "c.py").write_text("")
    assert import_cycle(module_graph(tmp_path, "policy_bundle.pkg")) == []


def test_no_two_modules_share_a_file_name():
    """``canary.py`` in two packages reads as one module; each name says where it stands."""
    twice = same_named_modules([ROOT / f for f in NAMED_ONCE])
    assert not twice, "\n".join(f"{name}: {', '.join(str(p.relative_to(ROOT)) for p in paths)}"
                                 for name, paths in twice.items())


def test_the_name_check_catches_two_modules_of_one_name(tmp_path):
    for folder in ("serve", "build/gate"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "canary.py").write_text("")
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "serve" / "router.py").write_text("")
    twice = same_named_modules([tmp_path / "serve", tmp_path / "build"])
    assert list(twice) == ["canary.py"] and len(twice["canary.py"]) == 2


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
    for sub in sorted(p.parent for p in (ROOT / "build").glob("*/__init__.py")):  # build's stage sub-packages
        assert f"policy_bundle/build/{sub.name}/__init__.py" in names
    assert not [n for n in names if "example" in n.split("/")[-1]]  # the examples stay out of the wheel
    assert "policy_bundle/serve/router/service.py" in names and "policy_bundle/build/configs/main.yaml" in names


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
