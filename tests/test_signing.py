"""Signed bundles: `policy-bundle keygen`, `sign` and `verify --key` through the CLI, a store entry checked for who
signed it (not only that it matches its own recorded hash), symlinks refused, and a router that trusts a key refusing
an unsigned entry over a real `bentoml serve` and serving a signed one."""

import json
import shutil
import subprocess
import sys

import httpx
import pytest

from cli_helpers import SMALL, run_cli
from policy_bundle.bundle.manifest import BundleVerificationError, manifest_hash, sha256_file
from policy_bundle.bundle.signing import generate_key, sign_bundle, verify_signature
from policy_bundle.bundle.model_store import verify_entry
from serve_helpers import Server, bundle_version, complete, env_for


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {"ours": (d / "ours.key", generate_key(d / "ours.key")),
            "theirs": (d / "theirs.key", generate_key(d / "theirs.key"))}


def entry_like(bundle, tmp_path):
    """A store entry's layout (int8/ plus the manifest, golden set and signature) and the manifest hash a
    registration records."""
    root = tmp_path / "entry"
    shutil.copytree(bundle / "int8", root / "int8")
    for f in ("bundle.json", "golden.jsonl", "bundle.json.sig"):
        if (bundle / f).is_file():
            shutil.copy(bundle / f, root / f)
    return root, sha256_file(root / "bundle.json")


def test_keygen_sign_and_verify_through_the_cli(small_bundle, tmp_path):
    key = tmp_path / "build.key"
    res = run_cli("keygen", "--out", str(key))
    assert res.returncode == 0 and key.is_file() and (tmp_path / "build.key.pub").is_file(), res.stderr
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    assert run_cli("keygen", "--out", str(key)).returncode == 3  # never overwritten
    bundle = tmp_path / "bundle"
    shutil.copytree(small_bundle, bundle)
    (bundle / "bundle.json.sig").unlink(missing_ok=True)
    unsigned = run_cli("verify", str(bundle), "--key", str(tmp_path / "build.key.pub"))
    assert unsigned.returncode == 3 and "unsigned" in unsigned.stderr and "Traceback" not in unsigned.stderr
    assert run_cli("sign", str(bundle), "--key", str(key)).returncode == 0
    ok = run_cli("verify", str(bundle), "--key", str(tmp_path / "build.key.pub"))
    assert ok.returncode == 0 and "signed by trusted key" in ok.stdout, ok.stderr
    assert run_cli("verify", str(bundle)).returncode == 0  # the signature is outside the file table


def test_a_signature_names_who_signed_and_breaks_when_the_manifest_changes(small_bundle, keys, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(small_bundle, bundle)
    sign_bundle(bundle, keys["ours"][0])
    assert verify_signature(bundle, [keys["ours"][1]])
    with pytest.raises(BundleVerificationError, match="which this reader does not trust"):
        verify_signature(bundle, [keys["theirs"][1]])
    manifest = json.loads((bundle / "bundle.json").read_text())
    manifest["note"] = "edited"
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleVerificationError, match="does not match bundle.json"):
        verify_signature(bundle, [keys["ours"][1]])


def test_whoever_can_write_the_store_cannot_pass_a_replaced_artifact_as_signed(small_bundle, keys, tmp_path):
    """The recorded hash lives in the entry's own model.yaml: replace policy.ts, rehash, re-record, and the
    integrity check passes; the signature check does not."""
    bundle = tmp_path / "bundle"
    shutil.copytree(small_bundle, bundle)
    sign_bundle(bundle, keys["ours"][0])
    root, _ = entry_like(bundle, tmp_path)
    (root / "int8" / "policy.ts").write_bytes(b"not the built policy")
    manifest = json.loads((root / "bundle.json").read_text())
    manifest["files"]["int8/policy.ts"] = {"sha256": sha256_file(root / "int8" / "policy.ts"),
                                           "size": (root / "int8" / "policy.ts").stat().st_size}
    (root / "bundle.json").write_text(json.dumps(manifest))
    forged = manifest_hash(root)
    assert verify_entry(root, "int8", forged) == root / "int8"  # integrity alone: the forgery passes
    with pytest.raises(BundleVerificationError, match="does not match bundle.json"):
        verify_entry(root, "int8", forged, [keys["ours"][1]])


def test_a_symlink_in_a_store_entry_is_refused(small_bundle, tmp_path):
    root, sha = entry_like(small_bundle, tmp_path)
    verify_entry(root, "int8", sha)
    target = root / "int8" / "policy.ts"
    outside = tmp_path / "policy.ts"
    target.rename(outside)
    target.symlink_to(outside)  # same bytes, so the hashes match: the link itself is what is refused
    with pytest.raises(BundleVerificationError, match="a symlink in the store entry"):
        verify_entry(root, "int8", sha)


SIGN_AND_REGISTER = """
import sys
from pathlib import Path
from policy_bundle.build.artifacts.register import register_bundle
from policy_bundle.bundle.manifest import manifest_hash
from policy_bundle.bundle.signing import sign_bundle
bundle, key, version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
if key.name != "none":
    sign_bundle(bundle, key)
register_bundle(bundle, version, manifest_hash(bundle))
"""


def test_a_router_that_trusts_a_key_refuses_an_unsigned_entry_and_serves_a_signed_one(small_bundle, keys, tmp_path):
    import os

    home = tmp_path / "bentoml"
    bundle = tmp_path / "bundle"
    shutil.copytree(small_bundle, bundle)
    (bundle / "bundle.json.sig").unlink(missing_ok=True)
    version = bundle_version(bundle)
    for key, v in (("none", f"{version}-unsigned"), (str(keys["ours"][0]), version)):
        reg = subprocess.run([sys.executable, "-c", SIGN_AND_REGISTER, str(bundle), key, v],
                             env={**os.environ, "BENTOML_HOME": str(home)}, capture_output=True, text=True)
        assert reg.returncode == 0, reg.stderr[-2000:]
    trust = {"BENTOML_HOME": str(home), "POLICY_BUNDLE_TRUSTED_KEYS": str(keys["ours"][1])}
    refused = Server({**env_for(tmp_path, "unsigned", f"{version}-unsigned", vllm=False), **trust},
                     tmp_path / "unsigned.log")
    try:
        refused.proc.wait(timeout=180)
        log = refused.log.read_text()
    finally:
        refused.stop()
    assert refused.proc.returncode != 0 and "bundle.json.sig: missing: the bundle is unsigned" in log
    assert "Traceback" not in log
    server = Server({**env_for(tmp_path, "signed", version, vllm=False), **trust}, tmp_path / "signed.log").wait_ready()
    try:
        assert complete(server).status_code == 200
        fp16 = httpx.get(f"{server.url}/status", timeout=30).json()["variants"]["fp16"]
        assert fp16["verified_copy"] is True  # the FP16 engine opens its files by path: a private verified copy
    finally:
        server.stop()


def test_an_engine_that_opens_files_by_path_gets_the_bytes_that_were_hashed(small_bundle, tmp_path):
    """vLLM opens the FP16 directory by path: with trusted keys it loads a private copy made while hashing, and a
    file changed after the entry's verification is refused, not loaded."""
    from policy_bundle.bundle.layout import FP16_DIR
    from policy_bundle.bundle.manifest import read_manifest
    from policy_bundle.serve.model_entries import verified_copy

    bundle = tmp_path / "bundle"
    shutil.copytree(small_bundle, bundle)
    copy = verified_copy(bundle, FP16_DIR)
    files = sorted(rel for rel in read_manifest(bundle)["files"] if rel.startswith(f"{FP16_DIR}/"))
    assert sorted(f"{FP16_DIR}/{p.relative_to(copy)}" for p in copy.rglob("*") if p.is_file()) == files
    assert oct(copy.stat().st_mode & 0o777) == "0o700"
    config = bundle / FP16_DIR / "config.json"
    config.write_text(config.read_text().replace("}", ', "swapped": true}', 1))
    with pytest.raises(SystemExit, match="config.json: changed after it was verified"):
        verified_copy(bundle, FP16_DIR)


def test_a_build_with_a_signing_key_signs_its_bundle_and_a_bad_key_stops_it_before_its_first_stage(tmp_path):
    pub = generate_key(tmp_path / "build.key")
    (tmp_path / "bad.key").write_text("not a key\n")
    args = ("build", "--config", "build/configs/main.yaml", *SMALL, "--set", "gate.enabled=false",
            "--set", "export.onnx=false", "--set", "calibration.procs=0", "--set", "name=signed")
    bad = run_cli(*args, "--out", str(tmp_path / "refused"), env={"POLICY_BUNDLE_SIGNING_KEY": str(tmp_path / "bad.key")})
    assert bad.returncode != 0 and "POLICY_BUNDLE_SIGNING_KEY" in bad.stderr and "Traceback" not in bad.stderr
    assert "load policy" not in bad.stdout + bad.stderr and not (tmp_path / "refused").exists()  # no stage ran
    built = run_cli(*args, "--out", str(tmp_path / "bundle"), env={"POLICY_BUNDLE_SIGNING_KEY": str(tmp_path / "build.key")})
    assert built.returncode == 0, built.stderr[-2000:]
    assert (tmp_path / "bundle" / "bundle.json.sig").is_file()
    ok = run_cli("verify", str(tmp_path / "bundle"), "--key", str(pub))
    assert ok.returncode == 0 and "signed by trusted key" in ok.stdout, ok.stderr


def test_a_torchscript_changed_after_verification_is_refused_not_loaded(small_bundle, tmp_path):
    """The INT8 TorchScript is loaded from the bytes that were hashed: a file swapped after the entry's check is
    refused (the control: the file as verified loads)."""
    from policy_bundle.bundle.layout import INT8_TORCHSCRIPT
    from policy_bundle.serve.model_entries import verified_bytes

    bundle = tmp_path / "bundle"
    shutil.copytree(small_bundle, bundle)
    assert verified_bytes(bundle, INT8_TORCHSCRIPT) == (bundle / INT8_TORCHSCRIPT).read_bytes()
    (bundle / INT8_TORCHSCRIPT).write_bytes((bundle / INT8_TORCHSCRIPT).read_bytes() + b"\0")
    with pytest.raises(SystemExit, match="changed after it was verified"):
        verified_bytes(bundle, INT8_TORCHSCRIPT)


def test_a_verified_copy_of_a_process_that_is_gone_is_removed_at_the_next_start(small_bundle, tmp_path, monkeypatch):
    import subprocess as sp
    import tempfile

    from policy_bundle.bundle.layout import FP16_DIR
    from policy_bundle.serve.model_entries import verified_copy

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = sp.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"policy-bundle-copy-{gone.pid}-x"  # a killed worker's copy: its atexit never ran
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"0" * 1024)
    mine = tmp_path / "policy-bundle-copy-1-y"  # pid 1 is alive: not ours to remove
    mine.mkdir()
    copy = verified_copy(small_bundle, FP16_DIR)
    assert copy.parent == tmp_path and copy.is_dir() and not stale.exists() and mine.exists()
