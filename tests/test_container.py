"""`policy-bundle containerize` (bentoml build + bentoml containerize --backend podman) makes an image that
serves both variants over HTTP, carries the models it was built from, and rebuilds from cache.

Select with ``-m container``; needs podman (``.ci/run`` installs it and points CONTAINERS_CONF at
``.ci/containers.conf``, this machine's runc/cgroupfs settings).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from cli_helpers import CLI, ROOT
from serve_helpers import bundle_version, free_port, register_into

PODMAN = shutil.which("podman")
ENV = {"CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(ROOT / ".ci" / "containers.conf")),
       "BENTOML_DO_NOT_TRACK": "True"}
ADMIN_TOKEN = "test-admin-token"
needs_podman = pytest.mark.skipif(PODMAN is None, reason="podman is not installed (.ci/run installs it)")


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PODMAN, *args], env={**os.environ, **ENV}, capture_output=True, text=True, timeout=timeout)


def logs(name: str) -> str:
    res = podman("logs", "--tail", "80", name)
    return (res.stdout + res.stderr)[-6000:]


def status(url: str) -> str:
    try:
        return httpx.get(f"{url}/status", timeout=5).text[:2000]
    except httpx.HTTPError as exc:
        return f"/status: {exc}"


def containerize(home, *args: str) -> tuple:
    """The CLI in a fresh process; (result, seconds)."""
    t0 = time.monotonic()
    res = subprocess.run([*CLI, "containerize", *args], cwd=ROOT, env={**os.environ, **ENV, "BENTOML_HOME": str(home)},
                         capture_output=True, text=True, timeout=1800)
    return res, time.monotonic() - t0


@pytest.fixture(scope="module")
def signing(tmp_path_factory) -> dict:
    """A build signing key pair (``policy-bundle keygen``): the image's entries are signed with it."""
    from policy_bundle.bundle.signing import generate_key

    key = tmp_path_factory.mktemp("container-key") / "build.key"
    return {"key": key, "pub": generate_key(key)}


@pytest.fixture(scope="module")
def home(small_bundle, signing, tmp_path_factory):
    """An isolated BentoML store holding the small bundle's two entries, signed (a router without trusted keys
    serves them as it would unsigned ones; the Kubernetes manifests' router trusts only signed entries)."""
    from policy_bundle.bundle.signing import sign_bundle

    home = tmp_path_factory.mktemp("container-home")
    bundle = tmp_path_factory.mktemp("container-bundle") / "bundle"
    shutil.copytree(small_bundle, bundle)
    sign_bundle(bundle, signing["key"])
    register_into(bundle, home)
    return home


@pytest.fixture(scope="module")
def image(home):
    res, seconds = containerize(home)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    built = re.search(r"^image: (\S+) \(([\d.]+) GB\) from bento (\S+)$", res.stdout, re.M)
    assert built, res.stdout
    print(f"\ncontainerize (first in this store): {seconds:.0f}s, {built[1]} {built[2]} GB", file=sys.stderr)
    return {"image": built[1], "bento": built[3], "seconds": seconds}


def run_container(image: str, name: str, *extra: str) -> str:
    """``image`` running as `podman run --network host` on a free port, admin token set, until /readyz; its URL."""
    port = free_port()
    run = podman("run", "-d", "--rm", "--name", name, "--network", "host", "--shm-size", "1g",
                 "-e", f"POLICY_BUNDLE_ADMIN_TOKEN={ADMIN_TOKEN}", *extra, image, "--port", str(port), "--host",
                 "127.0.0.1")
    assert run.returncode == 0, run.stderr
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if podman("container", "exists", name).returncode != 0:
            pytest.fail(f"container exited before /readyz:\n{logs(name)}")
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    pytest.fail(f"container not ready in 600s: {status(url)}\n{logs(name)}")


@pytest.fixture(scope="module")
def container(image, tmp_path_factory):
    """The image running as `podman run --network host` on a free port, admin token set, its rollout state on a
    volume (the last test replaces the container on it); stopped and the volume removed after."""
    name, volume = f"policy-bundle-test-{os.getpid()}", f"policy-bundle-state-{os.getpid()}"
    try:
        yield {"url": run_container(image["image"], name, "-v", f"{volume}:/home/bentoml/state"), "name": name,
               "volume": volume, "image": image["image"]}
    finally:
        podman("rm", "-f", "-t", "20", name)
        podman("volume", "rm", "-f", volume)


def complete(url: str, variant: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", headers={"x-policy-variant": variant, "x-admin-token": ADMIN_TOKEN},
                   json={"model": "policy", "prompt": "358+64=", "temperature": 0, "max_tokens": 6}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_containerize_without_podman_is_one_line(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    res = subprocess.run([*CLI, "containerize"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PATH": str(empty), "BENTOML_HOME": str(tmp_path)})
    assert res.returncode == 3
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert res.stderr.startswith("error: podman: not found on PATH") and "apt-get install -y podman" in res.stderr


@needs_podman
def test_containerize_an_unknown_bento_is_one_line(home):
    res, _ = containerize(home, "--bento", "policy-bundle:nosuchversion")
    assert res.returncode == 3, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == ("error: --bento: policy-bundle:nosuchversion is not in the "
                                                   f"BentoML store (BENTOML_HOME={home})")


@needs_podman
@pytest.mark.container
def test_the_kubernetes_manifests_run_under_podman_kube_play(image, signing, tmp_path):
    """deploy/kubernetes/ played by ``podman kube play`` on the built image (tests/kube_play.py says what podman
    cannot play and what stands in for it): PostgreSQL initialised from its Secret, both router replicas ready on
    it, a pause sent to one with ``policy-bundle rollout`` obeyed by the other, then torn down with nothing left.
    It comes before the tests that use ``container``, whose router would otherwise run beside these two."""
    import secrets as tokens

    import kube_play

    docs = kube_play.load_documents()
    configmaps, kube_secrets = kube_play.by_kind_in(docs, "ConfigMap"), kube_play.by_kind_in(docs, "Secret")
    (deployment,) = kube_play.by_kind_in(docs, "Deployment").values()
    (statefulset,) = kube_play.by_kind_in(docs, "StatefulSet").values()
    password, admin_token, api_key = tokens.token_hex(12), tokens.token_hex(16), tokens.token_hex(16)
    pg_host = statefulset["spec"]["serviceName"]
    values = {  # what the operator writes in place of secrets.yaml's placeholders (deploy/kubernetes/README.md)
        "policy-bundle-secrets": {"admin-token": admin_token, "api-keys": api_key,
                                  "state-url": f"postgresql+psycopg://policy:{password}@{pg_host}:5432/rollout"},
        "policy-bundle-postgres": {"password": password}}
    signing_cm = configmaps["policy-bundle-signing"]
    signing_cm["data"]["build.key.pub"] = signing["pub"].read_text()  # the placeholder key replaced
    configmap_args = []
    for name, cm in configmaps.items():
        configmap_args += ["--configmap", str(kube_play.write_all(tmp_path / f"configmap-{name}.yaml", [cm]))]
    postgres_yaml = kube_play.write_all(tmp_path / "postgres.yaml", kube_play.statefulset_as_pod(
        statefulset, kube_play.ensure_postgres_image(podman)))
    router_yaml = kube_play.write_all(tmp_path / "router.yaml", [kube_play.with_image(deployment, image["image"])])
    network = f"policy-bundle-kube-{os.getpid()}"
    router_pods = [f"{deployment['metadata']['name']}-pod-{i}" for i in range(deployment["spec"]["replicas"])]

    def down() -> None:
        for played in (router_yaml, postgres_yaml):
            podman("kube", "down", str(played), timeout=120)
        for name in kube_secrets:
            podman("secret", "rm", name)
        podman("volume", "rm", "-f", f"data-{statefulset['metadata']['name']}")
        podman("network", "rm", "-f", network)

    def ip(pod: str) -> str:
        res = podman("pod", "inspect", "--format", "{{.InfraContainerID}}", pod)
        got = podman("inspect", "--format", f"{{{{(index .NetworkSettings.Networks \"{network}\").IPAddress}}}}",
                     res.stdout.strip())
        assert got.returncode == 0 and got.stdout.strip(), got.stderr
        return got.stdout.strip()

    def pod_logs(pods) -> str:
        return "\n".join(f"== {p}\n{logs(p + '-' + c)}" for p, c in pods)

    down()  # what an interrupted run left
    try:
        assert podman("network", "create", network).returncode == 0  # DNS on: pod names resolve, as Services do
        for name, secret in kube_secrets.items():
            path = tmp_path / f"secret-{name}.json"
            path.write_text(kube_play.secret_json(secret, values[name]))
            created = podman("secret", "create", name, str(path))
            assert created.returncode == 0, created.stderr

        played = podman("kube", "play", "--network", network, str(postgres_yaml), timeout=300)
        assert played.returncode == 0, played.stderr[-3000:]
        pg_container = f"{pg_host}-{statefulset['spec']['template']['spec']['containers'][0]['name']}"
        probe = statefulset["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
        deadline = time.monotonic() + 120
        while podman("exec", pg_container, *probe).returncode != 0:  # the manifest's own readiness probe
            assert time.monotonic() < deadline, f"PostgreSQL not ready in 120 s:\n{logs(pg_container)}"
            time.sleep(2)

        played = podman("kube", "play", "--network", network, *configmap_args, str(router_yaml), timeout=600)
        assert played.returncode == 0, played.stderr[-3000:]
        containers = [(pod, "router") for pod in router_pods]
        urls = {pod: f"http://{ip(pod)}:3000" for pod in router_pods}
        deadline = time.monotonic() + 900
        waiting = set(router_pods)
        while waiting:
            assert time.monotonic() < deadline, f"not ready in 900 s: {sorted(waiting)}\n{pod_logs(containers)}"
            for pod in sorted(waiting):
                running = podman("container", "inspect", "--format", "{{.State.Running}}", f"{pod}-router")
                assert running.stdout.strip() == "true", f"{pod} exited:\n{pod_logs(containers)}"
                try:
                    if httpx.get(f"{urls[pod]}/readyz", timeout=5).status_code == 200:
                        waiting.discard(pod)
                except httpx.HTTPError:
                    pass
            time.sleep(3)

        a, b = (urls[pod] for pod in router_pods)
        answer = httpx.post(f"{b}/v1/completions", headers={"Authorization": f"Bearer {api_key}"}, timeout=120,
                            json={"model": "policy", "prompt": "358+64=", "temperature": 0, "max_tokens": 6})
        assert answer.status_code == 200, answer.text
        assert httpx.post(f"{b}/v1/completions", json={"model": "policy", "prompt": "1+1="},
                          timeout=60).status_code == 401  # the Secret's API keys are enforced

        def rollout(url: str, command: str) -> subprocess.CompletedProcess:
            return subprocess.run([*CLI, "rollout", command, "--url", url, "--token", admin_token], cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)

        paused = rollout(a, "pause")
        assert paused.returncode == 0, paused.stderr
        deadline, seen = time.monotonic() + 30, ""
        while "paused" not in seen:  # replica b reads the shared state in PostgreSQL
            assert time.monotonic() < deadline, f"replica b did not obey the pause sent to a:\n{seen}"
            seen = rollout(b, "status").stdout
            time.sleep(1)
        state = httpx.get(f"{b}/admin/rollout", headers={"Authorization": f"Bearer {admin_token}"}, timeout=30)
        assert state.json()["state"]["status"] == "paused", state.text
    finally:
        down()
    left = podman("ps", "-a", "--format", "{{.Names}}").stdout.split()
    assert not [n for n in left if n.startswith((pg_host, deployment["metadata"]["name"]))], left
    assert podman("pod", "exists", router_pods[0]).returncode != 0 and podman("pod", "exists", pg_host).returncode != 0


@needs_podman
@pytest.mark.container
def test_the_image_serves_both_variants_over_http(container):
    for variant in ("int8", "fp16"):
        done = complete(container["url"], variant)
        assert done["policy_variant"] == variant and done["choices"][0]["text"] == "998"


@needs_podman
@pytest.mark.container
def test_the_image_streams_a_chat_completion(container):
    from openai import OpenAI

    client = OpenAI(base_url=f"{container['url']}/v1", api_key="unused")
    streamed = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "12+34="}],
                                              max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "46"


@needs_podman
@pytest.mark.container
def test_policy_bundle_verify_passes_inside_the_image_with_the_store_entries_manifest(container, home,
                                                                                     small_bundle):
    from policy_bundle.bundle.manifest import manifest_hash

    res = podman("exec", "-w", "/home/bentoml/bento/src", container["name"], "python", "-m", "policy_bundle.build.cli",
                 "verify", "/home/bentoml/bento")  # src/: the bento's sources, as `bentoml serve` imports them
    assert res.returncode == 0, res.stdout + res.stderr
    reported = dict(re.findall(r"^ok: (\S+) matches its manifest \(sha256 (\w+)\)$", res.stdout, re.M))
    # the image leaves out triton (1 GB nothing on a CPU runs), and its FP16 variant still answered on vLLM above
    res = podman("exec", container["name"], "python", "-c", "import importlib.util as u; print(u.find_spec('triton'))")
    assert res.returncode == 0 and res.stdout.strip() == "None", res.stdout + res.stderr
    version = bundle_version(small_bundle)
    assert set(reported) == {f"policy-int8:{version}", f"policy-fp16:{version}"}
    for tag, sha in reported.items():  # the host store entry the image was built from
        entry = subprocess.run([sys.executable, "-m", "bentoml", "models", "get", tag, "-o", "json"], text=True,
                               capture_output=True, env={**os.environ, "BENTOML_HOME": str(home)}, cwd=ROOT)
        info = json.loads(entry.stdout)
        assert sha == info["metadata"]["manifest_sha256"] == manifest_hash(small_bundle)
        assert info["labels"]["manifest_sha256"] == sha[:32]


@needs_podman
@pytest.mark.container
def test_the_image_holds_the_locked_versions_of_the_serving_packages(container):
    """bentofile.yaml installs requirements/serve.txt: every package it pins is in the image at that version."""
    res = podman("exec", container["name"], "python", "-c", "import json, re; from importlib import metadata as m; "
                 "print(json.dumps({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower(): d.version "
                 "for d in m.distributions()}))")
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)
    pinned = dict(line.split("==", 1) for line in (ROOT / "requirements" / "serve.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    assert len(pinned) > 100
    assert {name: (version, found.get(name)) for name, version in pinned.items() if found.get(name) != version} == {}


@needs_podman
@pytest.mark.container
def test_a_second_containerize_reuses_the_package_layers(image, home):
    res, seconds = containerize(home)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    print(f"\ncontainerize (again, new bento of the same bundle): {seconds:.0f}s", file=sys.stderr)
    # the package install step (the image's big layer), then buildah's verdict on it
    # (BentoML relays buildah's lines with a log prefix: "INFO: STEP 29/35: RUN ...", "INFO: --> Using cache ...")
    assert re.search(r"RUN bash -euxo pipefail \S+/install\.sh\n[^\n]*--> Using cache", res.stderr), res.stderr[-4000:]


@needs_podman
@pytest.mark.container
def test_a_rolled_back_int8_stays_rolled_back_when_the_container_is_replaced(container):
    """The rollout state lived in the container's ephemeral HOME: a replaced container started the pair's rollout
    over at its first step, the rolled-back INT8 included. The image keeps it in /home/bentoml/state, a volume.
    (Last in this file: it rolls the module's container back and replaces it.)"""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    r = httpx.post(f"{container['url']}/admin/rollout", headers=admin, timeout=60,
                   json={"action": "rollback", "reason": "container test"})
    assert r.status_code == 200 and r.json()["state"]["status"] == "rolled-back", r.text
    podman("rm", "-f", "-t", "20", container["name"])
    name = f"{container['name']}-replaced"
    try:
        url = run_container(container["image"], name, "-v", f"{container['volume']}:/home/bentoml/state")
        state = httpx.get(f"{url}/admin/rollout", headers=admin, timeout=60).json()["state"]
        assert (state["status"], state["weight"]) == ("rolled-back", 0.0), state
    finally:
        podman("rm", "-f", "-t", "20", name)
