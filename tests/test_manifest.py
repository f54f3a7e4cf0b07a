"""Manifest: every file hashed; verify names the file that changed, vanished or appeared."""

from pathlib import Path

import pytest

from policy_bundle.bundle.manifest import BundleVerificationError, read_manifest, verify_bundle, write_manifest


@pytest.fixture
def bundle(tmp_path):
    (tmp_path / "int8").mkdir()
    (tmp_path / "int8" / "policy.ts").write_bytes(b"weights")
    (tmp_path / "golden.jsonl").write_text("{}\n")
    write_manifest(tmp_path, {"format": "test"})
    return tmp_path


def test_manifest_lists_sha256_and_size_of_every_file(bundle):
    files = read_manifest(bundle)["files"]
    assert set(files) == {"int8/policy.ts", "golden.jsonl"}
    assert files["int8/policy.ts"]["size"] == 7 and len(files["int8/policy.ts"]["sha256"]) == 64
    assert verify_bundle(bundle) == 2


def test_modified_file_is_named(bundle):
    (bundle / "int8" / "policy.ts").write_bytes(b"weightz")
    with pytest.raises(BundleVerificationError, match="int8/policy.ts: sha256 differs"):
        verify_bundle(bundle)


def test_missing_and_added_files_are_named(bundle):
    (bundle / "extra.bin").write_bytes(b"x")
    with pytest.raises(BundleVerificationError, match="extra.bin: not listed"):
        verify_bundle(bundle)
    (bundle / "extra.bin").unlink()
    (bundle / "golden.jsonl").unlink()
    with pytest.raises(BundleVerificationError, match="golden.jsonl: missing"):
        verify_bundle(bundle)


# ---- store entries: verified against the manifest hash recorded at registration -------------


def store_entry(tmp_path, dirs=("int8",)):
    """A bundle and its INT8 store entry (artifact dirs + manifest + golden set), with the recorded hash."""
    import shutil

    from policy_bundle.bundle.manifest import manifest_hash

    bundle = tmp_path / "bundle"
    for rel, text in (("int8/policy.ts", "weights"), ("int8/config.json", "{}"), ("fp16/model.safetensors", "w"),
                      ("int8-vllm/model.safetensors", "int8 weights"),
                      ("golden.jsonl", '{"prompt": "1+1=", "prompt_ids": [1], "completion_ids": [2]}\n')):
        (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
        (bundle / rel).write_text(text)
    write_manifest(bundle, {"format": "policy-bundle/1"})
    entry = tmp_path / "entry"
    for d in dirs:
        shutil.copytree(bundle / d, entry / d)
    for f in ("bundle.json", "golden.jsonl"):
        shutil.copy(bundle / f, entry / f)
    (entry / "model.yaml").write_text("name: policy-int8\n")  # BentoML's own file
    return entry, manifest_hash(bundle)


def test_store_entry_verifies_against_the_registered_manifest_hash(tmp_path):
    import json

    from policy_bundle.bundle.manifest import hash_tree
    from policy_bundle.bundle.model_store import verify_entry

    entry, sha = store_entry(tmp_path)
    assert verify_entry(entry, "int8", sha) == entry / "int8"
    # a manifest rewritten to match a tampered artifact no longer matches the hash recorded at registration
    (entry / "int8" / "policy.ts").write_text("evil")
    manifest = json.loads((entry / "bundle.json").read_text())
    manifest["files"].update({k: v for k, v in hash_tree(entry).items() if k.startswith("int8/")})
    (entry / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleVerificationError, match="recorded at registration"):
        verify_entry(entry, "int8", sha)
    with pytest.raises(BundleVerificationError, match="records no manifest_sha256"):
        verify_entry(entry, "int8", None)


@pytest.mark.parametrize("tamper, message", [
    (lambda e: (e / "int8" / "extra.py").write_text("import os"), "int8/extra.py: not listed"),
    (lambda e: (e / "golden.jsonl").write_text("{}\n"), "golden.jsonl: "),
    (lambda e: (e / "int8" / "config.json").unlink(), "int8/config.json: missing"),
    (lambda e: (e / "surprise.bin").write_text("x"), "surprise.bin: not part of the store entry"),
])
def test_store_entry_refuses_added_changed_and_missing_files(tmp_path, tamper, message):
    from policy_bundle.bundle.model_store import verify_entry

    entry, sha = store_entry(tmp_path)
    tamper(entry)
    with pytest.raises(BundleVerificationError, match=message):
        verify_entry(entry, "int8", sha)


def test_int8_entry_verifies_its_int8_vllm_dir_whichever_it_serves(tmp_path):
    from policy_bundle.bundle.model_store import verify_entry

    entry, sha = store_entry(tmp_path, dirs=("int8", "int8-vllm"))
    assert verify_entry(entry, "int8-vllm", sha) == entry / "int8-vllm"
    (entry / "int8-vllm" / "model.safetensors").write_text("evil weights")
    with pytest.raises(BundleVerificationError, match="int8-vllm/model.safetensors: sha256 differs"):
        verify_entry(entry, "int8", sha)
    with pytest.raises(BundleVerificationError, match="fp16/: not in the store entry"):
        verify_entry(entry, "fp16", sha)


def test_paths_hashed_as_they_are_read_are_checked_here_for_size_only(tmp_path, monkeypatch):
    """A served weight read through a hashing reader (a private verified copy, ``verified_bytes``) is not hashed by
    the entry's verification too: it is read once. Its presence and size are still checked here, and every other
    file is hashed (without the deferral the same change is refused here: the negative control)."""
    from policy_bundle.bundle import manifest as mf
    from policy_bundle.bundle.model_store import verify_entry

    entry, sha = store_entry(tmp_path, dirs=("int8", "int8-vllm"))
    hashed = []
    real = mf.sha256_file
    monkeypatch.setattr(mf, "sha256_file", lambda p: hashed.append(Path(p).relative_to(entry).as_posix()) or real(p))
    (entry / "int8" / "policy.ts").write_text("WEIGHTS")  # same size, other bytes: its reader refuses it
    assert verify_entry(entry, "int8", sha, hashed_on_read=["int8/policy.ts", "int8-vllm"]) == entry / "int8"
    assert "int8/policy.ts" not in hashed and not any(h.startswith("int8-vllm/") for h in hashed)
    assert "int8/config.json" in hashed and "golden.jsonl" in hashed
    with pytest.raises(BundleVerificationError, match="int8/policy.ts: sha256 differs"):
        verify_entry(entry, "int8", sha)
    (entry / "int8-vllm" / "model.safetensors").write_text("short")
    with pytest.raises(BundleVerificationError, match="int8-vllm/model.safetensors: size"):
        verify_entry(entry, "int8", sha, hashed_on_read=["int8/policy.ts", "int8-vllm"])


@pytest.mark.parametrize("path", ["../outside", "/etc/passwd", "int8/../../x", "int8//x", "int8\\\\x"])
def test_manifest_paths_must_stay_inside_the_bundle(tmp_path, path):
    from policy_bundle.bundle.manifest import verify_files

    with pytest.raises(BundleVerificationError, match="not a relative path inside the bundle"):
        verify_files(tmp_path, {"files": {path: {"sha256": "0" * 64, "size": 1}}})
