"""What a build does to its ``--out`` and the directory around it, through the real CLI: ``--force``
replaces only a bundle or an empty directory; a killed build's partial directory is removed by the
next build to the same parent (a running build's is not); the model store is written only once the
bundle is in place, so a failed registration leaves the bundle whole."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cli_helpers import run_cli

FAST = ("--set", "calibration.procs=0", "--set", "calibration.samples=64", "--set", "calibration.batch_size=16",
        "--set", "calibration.golden=32", "--set", "export.onnx=false", "--set", "export.int8_vllm=false",
        "--set", "gate.enabled=false")


def not_a_bundle(kind: str, out: Path) -> Path:
    """Something at ``--out`` that --force must not delete; returns the file that must survive."""
    if kind == "file":
        out.write_text("my notes\n")
        return out
    out.mkdir()
    if kind == "foreign bundle.json":
        (out / "bundle.json").write_text(json.dumps({"format": "someone-else/3"}))
        return out / "bundle.json"
    (out / "thesis.tex").write_text("years of work\n")
    return out / "thesis.tex"


@pytest.mark.parametrize("kind", ["directory with other files", "file", "foreign bundle.json"])
def test_force_never_deletes_what_is_not_a_bundle(kind, tmp_path, bentoml_home):
    out = tmp_path / "out"
    keep = not_a_bundle(kind, out)
    before = keep.read_bytes()
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), "--force", *FAST)
    assert res.returncode == 3, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --out:") and "not a bundle" in lines[0], res.stderr
    assert keep.read_bytes() == before and not list(tmp_path.glob(".*partial*"))


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def built_with_a_broken_store(tmp_path_factory, reference_dir):
    """A build into an empty --out (with --force) beside a killed build's and a running build's partial
    directories, registering into a model store that cannot be written."""
    root = tmp_path_factory.mktemp("out")
    out = root / "bundle"
    out.mkdir()
    stale = root / f".bundle.partial-{dead_pid()}-k1lled"
    (stale / "int8").mkdir(parents=True)
    (stale / "int8" / "policy.ts").write_bytes(b"half")
    live = root / f".other.partial-{os.getpid()}-running"
    live.mkdir()
    # a build of "kept" killed between the two renames of its swap: its old bundle set aside, its new one partial
    pid = dead_pid()
    aside = root / f".kept.replaced-{pid}-sw4p" / "kept"
    aside.mkdir(parents=True)
    (aside / "bundle.json").write_text('{"old": true}')
    (root / f".kept.partial-{pid}-n3w").mkdir()
    store = tmp_path_factory.mktemp("store")
    (store / "models").write_text("not a directory\n")  # BentoML cannot create any entry here
    res = run_cli("build", "--config", "build/configs/main.yaml", "--out", str(out), "--force", *FAST,
                  env={"BENTOML_HOME": str(store)})
    return res, out, stale, live


def test_a_bundle_set_aside_by_a_build_killed_mid_swap_is_put_back(built_with_a_broken_store):
    """A kill between the swap's two renames left --out missing, and the next build's clean-up removed both bundles."""
    res, out, _, _ = built_with_a_broken_store
    kept = out.parent / "kept"
    assert json.loads((kept / "bundle.json").read_text()) == {"old": True}
    assert f"restored {kept}: the bundle a build" in res.stderr
    assert not list(out.parent.glob(".kept.*"))  # both of the dead build's work directories are gone


def test_a_bundle_is_replaced_in_one_step_where_the_kernel_can(tmp_path):
    """renameat2(RENAME_EXCHANGE): --out is the old bundle, then the new one, with no moment in between; the two
    renames of the fallback are not used (they would fail here)."""
    from policy_bundle.build.artifacts import output_dir

    out, tmp = tmp_path / "bundle", tmp_path / ".bundle.partial-1-x"
    for d, tag in ((out, "old"), (tmp, "new")):
        d.mkdir()
        (d / "bundle.json").write_text(json.dumps({"format": output_dir.FORMAT, "files": {}, "tag": tag}))
    real_rename = Path.rename

    def no_rename(self, target):
        raise AssertionError(f"renamed {self} -> {target}")

    Path.rename = no_rename
    try:
        output_dir.move_into_place(tmp, out, force=True)
    finally:
        Path.rename = real_rename
    assert json.loads((out / "bundle.json").read_text())["tag"] == "new" and not tmp.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


def test_a_killed_builds_partial_dir_is_removed_and_a_running_ones_kept(built_with_a_broken_store):
    res, out, stale, live = built_with_a_broken_store
    assert not stale.exists() and f"removed {stale}" in res.stderr, res.stderr[-2000:]
    assert live.is_dir()
    assert not [p for p in out.parent.glob(".bundle.*")]  # nor its own partial or set-aside directory


def test_registration_happens_once_the_bundle_is_in_place_and_its_failure_leaves_it_whole(built_with_a_broken_store):
    res, out, _, _ = built_with_a_broken_store
    assert res.returncode == 3 and "Traceback" not in res.stderr, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: register.bentoml: the bundle at") and "is complete" in last, last
    check = run_cli("verify", str(out))
    assert check.returncode == 0, check.stderr
