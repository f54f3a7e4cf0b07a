"""deploy/kubernetes/ played by ``podman kube play`` (Debian's podman 4.3): what a test needs to run the manifests as
written on one machine, and nothing more.

Podman plays Pods, Deployments and PersistentVolumeClaims; it has no Services, Secrets, StatefulSets or
PodDisruptionBudgets. So, as an operator's cluster would provide them:
- Secrets become podman secrets (``secretKeyRef`` reads a podman secret holding ``{key: base64 value}``), with
  the values an operator puts in place of the placeholders;
- ConfigMaps are passed with ``--configmap``;
- the PostgreSQL StatefulSet plays as its pod template, in a Pod named as its headless Service, with its volume
  claim as a PersistentVolumeClaim (a podman volume): on a network with DNS, the Service's name resolves to it;
- image names are replaced: the router's by the image the test built, PostgreSQL's by a stand-in built from
  Debian's packages (the official image cannot be pulled here) whose entrypoint keeps its environment contract;
- podman 4.3 publishes every ``containerPort`` on the host's port of the same number, so two replicas of one pod
  would collide: the ``ports`` lists are dropped (the pods are reached at their own addresses on the network, as a
  Service reaches them) and a probe's named port becomes its number;
- podman 4.3 makes an ``emptyDir`` of ``medium: Memory`` a root-owned directory on disk, where Kubernetes mounts a
  world-writable tmpfs: mounted on ``/dev/shm``, vLLM (user 1034) cannot make its semaphores there. The volume is
  dropped and the container's own ``/dev/shm``, podman's tmpfs, stands in.
Every other field (probes' targets, mounts, the security context, resources, env) is played as written.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "deploy" / "kubernetes"
ENTRYPOINT = Path(__file__).with_name("postgres-entrypoint.sh")
POSTGRES_IMAGE = "localhost/policy-bundle-postgres-standin:bookworm"
LABEL = "policy-bundle.standin"


def load_documents() -> List[Tuple[str, dict]]:
    """(file name, document) for every non-empty YAML document under deploy/kubernetes/."""
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        with open(path, encoding="utf-8") as f:
            docs.extend((path.name, doc) for doc in yaml.safe_load_all(f) if doc is not None)
    return docs


def by_kind_in(docs, kind: str) -> Dict[str, dict]:
    """``docs`` ((file name, document) pairs) of ``kind`` by name."""
    return {doc["metadata"]["name"]: doc for _, doc in docs if doc["kind"] == kind}


def ensure_postgres_image(podman: Callable[..., subprocess.CompletedProcess]) -> str:
    """The stand-in image (Debian bookworm's PostgreSQL and tests/postgres-entrypoint.sh), built once per entrypoint."""
    version = hashlib.sha256(ENTRYPOINT.read_bytes()).hexdigest()[:16]  # rebuilt when the entrypoint changes
    found = podman("image", "inspect", "--format", f'{{{{index .Labels "{LABEL}"}}}}', POSTGRES_IMAGE)
    if found.returncode == 0 and found.stdout.strip() == version:
        return POSTGRES_IMAGE
    with tempfile.TemporaryDirectory(prefix="policy-bundle-pg-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        hooks = [f"upload {ENTRYPOINT} /usr/local/bin/docker-entrypoint.sh",
                 'chmod 755 "$1"/usr/local/bin/docker-entrypoint.sh']
        res = subprocess.run(["mmdebstrap", "--variant=minbase", "--include=postgresql,ca-certificates",
                              *[f"--customize-hook={h}" for h in hooks], "bookworm", str(rootfs)],
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        changes = ["ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "ENV LANG=C.UTF-8", 'ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]', "EXPOSE 5432",
                   f"LABEL {LABEL}={version}"]
        res = podman("import", *[a for c in changes for a in ("--change", c)], str(rootfs), POSTGRES_IMAGE,
                     timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    return POSTGRES_IMAGE


def secret_json(secret: dict, values: Dict[str, str]) -> str:
    """A kube Secret as podman 4.3's ``secretKeyRef`` reads it: ``{key: base64 value}``, every key the manifest
    declares given a value by ``values`` (the placeholders replaced, as the operator must)."""
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    missing = keys - set(values)
    assert not missing, f"no value for {secret['metadata']['name']}: {sorted(missing)}"
    return json.dumps({k: base64.b64encode(values[k].encode()).decode() for k in sorted(keys)})


def statefulset_as_pod(sts: dict, image: str) -> List[dict]:
    """The StatefulSet's pod template as a Pod named as its Service, and its claim templates as claims."""
    pod_spec = copy.deepcopy(sts["spec"]["template"]["spec"])
    claims, volumes = [], pod_spec.setdefault("volumes", [])
    for tpl in sts["spec"].get("volumeClaimTemplates", []):
        claim_name = f"{tpl['metadata']['name']}-{sts['metadata']['name']}"
        claims.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                       "metadata": {"name": claim_name}, "spec": tpl["spec"]})
        volumes.append({"name": tpl["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}})
    for c in pod_spec["containers"]:
        c["image"] = image
        unpublished(c)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": sts["spec"]["serviceName"], "labels": sts["spec"]["template"]["metadata"]["labels"]},
           "spec": pod_spec}
    return [*claims, pod]


def with_image(deployment: dict, image: str) -> dict:
    dep = copy.deepcopy(deployment)
    pod = dep["spec"]["template"]["spec"]
    memory = {v["name"] for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"}
    pod["volumes"] = [v for v in pod.get("volumes", []) if v["name"] not in memory]
    for c in pod["containers"]:
        c["image"] = image
        c["volumeMounts"] = [m for m in c.get("volumeMounts", []) if m["name"] not in memory]
        unpublished(c)
    return dep


def unpublished(container: dict) -> None:
    """``container`` without its ``ports`` list (podman 4.3 would publish each on the host), its probes' named
    ports replaced by their numbers."""
    numbers = {p["name"]: p["containerPort"] for p in container.pop("ports", []) if "name" in p}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container.get(probe, {}).get("httpGet")
        if get and isinstance(get.get("port"), str):
            get["port"] = numbers[get["port"]]


def write_all(path: Path, docs: List[dict]) -> Path:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path
