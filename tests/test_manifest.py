"""Manifest: every file hashed; verify names the file that changed, vanished or appeared."""

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
