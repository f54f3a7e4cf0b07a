"""deploy/kubernetes/: every document is valid against the Kubernetes schema (strict: an unknown or misspelt field
fails), and the manifests keep their promises: two router replicas with readiness on /readyz and liveness on
/livez, every Secret / ConfigMap key a pod reads is defined there, the ConfigMap's router.yaml and the pod's
environment load with the router's own settings loader, and the state URL names the PostgreSQL the manifests run."""

from __future__ import annotations

import base64
import copy
import posixpath
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, major_minor

from kube_play import by_kind_in, load_documents

ROOT = Path(__file__).resolve().parents[1]
# the newest Kubernetes release kubernetes-validate 1.37 ships schemas for; every document is checked against it
KUBERNETES_VERSION = "1.37"
NAME = "policy-bundle"
ROUTER, POSTGRES = "policy-bundle-router", "policy-bundle-postgres"
SETTINGS_ENV = ("POLICY_BUNDLE_ROUTER_CONFIG", "POLICY_BUNDLE_API_KEYS", "POLICY_BUNDLE_TRUSTED_KEYS",
                "POLICY_BUNDLE_STATE_URL", "POLICY_BUNDLE_STATE_DIR", "POLICY_BUNDLE_ADMIN_TOKEN",
                "POLICY_BUNDLE_INT8_ENGINE")


DOCS = load_documents()


def by_kind(kind: str) -> dict[str, dict]:
    return by_kind_in(DOCS, kind)


def secret_data(secret: dict) -> dict[str, str]:
    """A Secret's keys and their text (the manifests write stringData; data would be base64)."""
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**data, **(secret.get("stringData") or {})}


def workloads(docs) -> list[dict]:
    return [doc for _, doc in docs if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def container(workload: dict, name: str) -> dict:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def config_refs(docs) -> list[tuple[str, str, str, str]]:
    """(who, kind, name, key) for every Secret / ConfigMap key a workload reads: env valueFrom, volume items, and
    a whole Secret / ConfigMap (key None) for envFrom and item-less volumes."""
    refs = []
    for wl in workloads(docs):
        spec = wl["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            who = f"{wl['metadata']['name']}/{c['name']}"
            for env in c.get("env", []):
                src = env.get("valueFrom", {})
                if "secretKeyRef" in src:
                    refs.append((f"{who} env {env['name']}", "Secret", src["secretKeyRef"]["name"],
                                 src["secretKeyRef"]["key"]))
                if "configMapKeyRef" in src:
                    refs.append((f"{who} env {env['name']}", "ConfigMap", src["configMapKeyRef"]["name"],
                                 src["configMapKeyRef"]["key"]))
            for env_from in c.get("envFrom", []):
                if "secretRef" in env_from:
                    refs.append((f"{who} envFrom", "Secret", env_from["secretRef"]["name"], None))
                if "configMapRef" in env_from:
                    refs.append((f"{who} envFrom", "ConfigMap", env_from["configMapRef"]["name"], None))
        for vol in spec.get("volumes", []):
            for kind, field, name_field in (("Secret", "secret", "secretName"), ("ConfigMap", "configMap", "name")):
                if field in vol:
                    source = vol[field]
                    keys = [item["key"] for item in source.get("items", [])] or [None]
                    refs.extend((f"{wl['metadata']['name']} volume {vol['name']}", kind, source[name_field], key)
                                for key in keys)
    return refs


def missing_refs(docs) -> list[str]:
    defined = {"Secret": {n: secret_data(s) for n, s in by_kind_in(docs, "Secret").items()},
               "ConfigMap": {n: (c.get("data") or {}) for n, c in by_kind_in(docs, "ConfigMap").items()}}
    missing = []
    for who, kind, name, key in config_refs(docs):
        if name not in defined[kind]:
            missing.append(f"{who}: {kind} {name} is not in deploy/kubernetes")
        elif key is not None and key not in defined[kind][name]:
            missing.append(f"{who}: {kind} {name} has no key {key!r} (it has {sorted(defined[kind][name])})")
    return missing


def mounted_files(workload: dict, container_spec: dict) -> dict[str, str]:
    """Container path -> text of every file the container's ConfigMap / Secret volume mounts put there."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    configmaps, secrets = by_kind("ConfigMap"), by_kind("Secret")
    files = {}
    for mount in container_spec.get("volumeMounts", []):
        vol = volumes[mount["name"]]
        if "configMap" in vol:
            source, data = vol["configMap"], configmaps[vol["configMap"]["name"]].get("data") or {}
        elif "secret" in vol:
            source, data = vol["secret"], secret_data(secrets[vol["secret"]["secretName"]])
        else:
            continue
        paths = {item["key"]: item["path"] for item in source.get("items", [])} or {k: k for k in data}
        for key, rel in paths.items():
            if "subPath" in mount:
                if rel == mount["subPath"]:
                    files[mount["mountPath"]] = data[key]
            else:
                files[posixpath.join(mount["mountPath"], rel)] = data[key]
    return files


def pod_env(container_spec: dict) -> dict[str, str]:
    """The container's environment with its Secret / ConfigMap references resolved from deploy/kubernetes."""
    configmaps, secrets = by_kind("ConfigMap"), by_kind("Secret")
    env = {}
    for var in container_spec.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secret_data(secrets[ref["name"]])[ref["key"]]
        elif "configMapKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = configmaps[ref["name"]]["data"][ref["key"]]
    return env


def router_config_text() -> str:
    return by_kind("ConfigMap")[ROUTER]["data"]["router.yaml"]


def clear_settings_env(monkeypatch) -> None:
    for var in SETTINGS_ENV:
        monkeypatch.delenv(var, raising=False)


# ---- the schema ------------------------------------------------------------------------------------------------

def test_the_pinned_kubernetes_version_is_shipped():
    shipped = {major_minor(v) for v in all_versions()}
    assert KUBERNETES_VERSION in shipped, (f"kubernetes-validate {kubernetes_validate.__version__} has no schemas "
                                           f"for Kubernetes {KUBERNETES_VERSION} (it has {sorted(shipped)})")


@pytest.mark.parametrize("doc", [d for _, d in DOCS], ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS])
def test_every_document_validates_strictly(doc):
    assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_negative_control_replicas_as_a_string_fails_validation():
    bad = copy.deepcopy(by_kind("Deployment")[ROUTER])
    bad["spec"]["replicas"] = "2"
    with pytest.raises(kubernetes_validate.ValidationError) as err:
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    assert list(err.value.path) == ["spec", "replicas"]


def test_negative_control_a_misspelt_field_fails_strict_validation():
    bad = copy.deepcopy(by_kind("Deployment")[ROUTER])
    c = bad["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


# ---- what the manifests hold -----------------------------------------------------------------------------------

def test_the_expected_resources_and_nothing_namespaced():
    found = {(doc["apiVersion"], doc["kind"], doc["metadata"]["name"]) for _, doc in DOCS}
    assert found == {
        ("apps/v1", "Deployment", ROUTER), ("v1", "Service", ROUTER), ("policy/v1", "PodDisruptionBudget", ROUTER),
        ("v1", "ConfigMap", ROUTER), ("v1", "Secret", "policy-bundle-secrets"),
        ("v1", "ConfigMap", "policy-bundle-signing"),
        ("v1", "Secret", POSTGRES), ("apps/v1", "StatefulSet", POSTGRES), ("v1", "Service", POSTGRES)}
    assert len(found) == len(DOCS), "a resource is defined twice"
    for _, doc in DOCS:
        assert "namespace" not in doc["metadata"], f"{doc['kind']}/{doc['metadata']['name']} names a namespace"
        labels = doc["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/name") == NAME
        assert labels.get("app.kubernetes.io/component") in ("router", "postgres")
    for secret in by_kind("Secret").values():
        assert secret["type"] == "Opaque" and secret.get("stringData") and "REPLACE-ME" in str(secret["stringData"])


def test_router_deployment():
    dep = by_kind("Deployment")[ROUTER]
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 30
    c = container(dep, "router")
    assert c["image"] == "localhost/policy-bundle:latest"
    assert c["args"] == ["--port", "3000"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 3000}

    def probe(name: str) -> tuple[str, int]:
        get = c[name]["httpGet"]
        return get["path"], ports.get(get["port"], get["port"])

    assert probe("readinessProbe") == ("/readyz", 3000)
    assert probe("livenessProbe") == ("/livez", 3000)
    # the models take ~60 s to load: liveness must not kill a pod that is still loading
    live = c["livenessProbe"]
    startup = c.get("startupProbe", {"periodSeconds": 0, "failureThreshold": 0})
    budget = max(live.get("initialDelaySeconds", 0) + live["periodSeconds"] * live["failureThreshold"],
                 startup["periodSeconds"] * startup["failureThreshold"])
    assert budget >= 120
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "6Gi"}
    assert c["resources"]["limits"] == {"memory": "8Gi"}
    sc = {**pod.get("securityContext", {}), **c["securityContext"]}
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 1034 and sc["allowPrivilegeEscalation"] is False

    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_CPU_KVCACHE_SPACE"]["value"] == "1"
    assert env["POLICY_BUNDLE_TRUSTED_KEYS"]["value"] == "/etc/policy-bundle/keys/build.key.pub"
    assert env["POLICY_BUNDLE_ROUTER_CONFIG"]["value"] == "/etc/policy-bundle/config/router.yaml"
    for var, key in (("POLICY_BUNDLE_STATE_URL", "state-url"), ("POLICY_BUNDLE_ADMIN_TOKEN", "admin-token"),
                     ("POLICY_BUNDLE_API_KEYS", "api-keys")):
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "policy-bundle-secrets", "key": key}

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    keys = mounts["/etc/policy-bundle/keys"]
    assert keys["readOnly"] is True and volumes[keys["name"]]["configMap"]["name"] == "policy-bundle-signing"
    config = mounts["/etc/policy-bundle/config"]  # the whole ConfigMap: a subPath mount misses its updates
    assert config["readOnly"] is True and "subPath" not in config


def test_every_secret_and_configmap_key_read_is_defined():
    refs = config_refs(DOCS)
    assert {(kind, name, key) for _, kind, name, key in refs} >= {
        ("Secret", "policy-bundle-secrets", "state-url"), ("Secret", "policy-bundle-secrets", "admin-token"),
        ("Secret", "policy-bundle-secrets", "api-keys"), ("ConfigMap", "policy-bundle-signing", "build.key.pub"),
        ("Secret", POSTGRES, "password"), ("ConfigMap", ROUTER, "router.yaml")}
    assert missing_refs(DOCS) == []


def test_negative_control_a_key_the_secret_lacks_is_reported():
    docs = copy.deepcopy(DOCS)
    dep = next(doc for _, doc in docs if doc["kind"] == "Deployment")
    env = next(e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
               if e["name"] == "POLICY_BUNDLE_API_KEYS")
    env["valueFrom"]["secretKeyRef"]["key"] = "api-key"
    assert missing_refs(docs) == [f"{ROUTER}/router env POLICY_BUNDLE_API_KEYS: Secret policy-bundle-secrets has no "
                                  "key 'api-key' (it has ['admin-token', 'api-keys', 'state-url'])"]


def test_selectors_match_their_pods_and_ports():
    pods = {wl["metadata"]["name"]: wl for wl in workloads(DOCS)}
    for wl in pods.values():
        labels = wl["spec"]["template"]["metadata"]["labels"]
        assert wl["spec"]["selector"]["matchLabels"].items() <= labels.items()

    def selected(selector: dict) -> list[str]:
        return [n for n, wl in pods.items() if selector.items() <= wl["spec"]["template"]["metadata"]["labels"].items()]

    services = by_kind("Service")
    assert selected(services[ROUTER]["spec"]["selector"]) == [ROUTER]
    assert selected(services[POSTGRES]["spec"]["selector"]) == [POSTGRES]
    assert selected(by_kind("PodDisruptionBudget")[ROUTER]["spec"]["selector"]["matchLabels"]) == [ROUTER]
    assert by_kind("PodDisruptionBudget")[ROUTER]["spec"]["minAvailable"] == 1
    assert by_kind("StatefulSet")[POSTGRES]["spec"]["serviceName"] == POSTGRES
    for name, want_port, want_target in ((ROUTER, 80, 3000), (POSTGRES, 5432, 5432)):
        (port,) = services[name]["spec"]["ports"]
        ports = {p["name"]: p["containerPort"] for c in pods[name]["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}
        assert port["port"] == want_port
        assert ports.get(port["targetPort"], port["targetPort"]) == want_target
    assert services[ROUTER]["spec"]["type"] == "ClusterIP"


def test_postgres_statefulset():
    sts = by_kind("StatefulSet")[POSTGRES]
    assert sts["spec"]["replicas"] == 1
    c = container(sts, "postgres")
    assert c["image"] == "docker.io/library/postgres:16"
    env = {e["name"]: e for e in c["env"]}
    assert env["POSTGRES_DB"]["value"] == "rollout" and env["POSTGRES_USER"]["value"] == "policy"
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": POSTGRES, "key": "password"}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert env["PGDATA"]["value"].startswith(mount["mountPath"] + "/")
    assert c["readinessProbe"]["exec"]["command"] == ["pg_isready", "-U", "policy", "-d", "rollout"]
    assert c["resources"]["requests"]


def test_state_url_names_the_postgres_the_manifests_run():
    url = urlsplit(secret_data(by_kind("Secret")["policy-bundle-secrets"])["state-url"])
    env = {e["name"]: e.get("value") for e in container(by_kind("StatefulSet")[POSTGRES], "postgres")["env"]}
    assert url.scheme == "postgresql+psycopg"
    assert (url.hostname, url.port) == (POSTGRES, by_kind("Service")[POSTGRES]["spec"]["ports"][0]["port"])
    assert url.username == env["POSTGRES_USER"] and url.path == "/" + env["POSTGRES_DB"]
    assert url.password == secret_data(by_kind("Secret")[POSTGRES])["password"]


# ---- the router's own settings loader --------------------------------------------------------------------------

def test_router_config_loads_with_the_settings_loader(tmp_path, monkeypatch):
    from policy_bundle.serve.settings import load_settings

    text = router_config_text()
    config = tmp_path / "router.yaml"
    config.write_text(text)
    clear_settings_env(monkeypatch)
    monkeypatch.setenv("POLICY_BUNDLE_ROUTER_CONFIG", str(config))
    s = load_settings()
    want = yaml.safe_load(text)
    for key, value in want.items():
        if key != "rollout":
            assert getattr(s, key) == value, key
    for key, value in want["rollout"].items():
        got = getattr(s.rollout, key)
        assert ([step.weight for step in got] if key == "steps" else got) == value, f"rollout.{key}"
    assert (s.max_inflight, s.request_timeout_s) == (32, 60.0)
    assert [step.weight for step in s.rollout.steps] == [1.0, 5.0, 25.0, 50.0, 100.0]


def test_router_pod_environment_loads_once_the_placeholder_key_is_replaced(tmp_path, monkeypatch):
    """The router container's environment and mounted files as the pod sees them (re-rooted under tmp_path): the
    placeholder public key stops start-up, a real one (``policy-bundle keygen``) starts it with the Secret's
    state URL, keys and token and the ConfigMap's settings."""
    from policy_bundle.bundle.signing import generate_key
    from policy_bundle.serve.settings import SettingsError, load_settings

    dep = by_kind("Deployment")[ROUTER]
    c = container(dep, "router")
    files = mounted_files(dep, c)
    for path, text in files.items():
        (tmp_path / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path.lstrip("/")).write_text(text)
    env = pod_env(c)
    for var in ("POLICY_BUNDLE_ROUTER_CONFIG", "POLICY_BUNDLE_TRUSTED_KEYS"):
        assert env[var] in files, f"{var}={env[var]} is not a file the pod's mounts provide ({sorted(files)})"
        env[var] = str(tmp_path / env[var].lstrip("/"))
    clear_settings_env(monkeypatch)
    for var, value in env.items():
        monkeypatch.setenv(var, value)

    with pytest.raises(SettingsError, match="trusted_keys: .*not a PEM public key"):
        load_settings()

    Path(env["POLICY_BUNDLE_TRUSTED_KEYS"]).write_bytes(generate_key(tmp_path / "build.key").read_bytes())
    s = load_settings()
    secrets = secret_data(by_kind("Secret")["policy-bundle-secrets"])
    assert s.state_url == secrets["state-url"]
    assert s.admin_token == secrets["admin-token"]
    assert s.api_keys == tuple(secrets["api-keys"].split(","))
    assert s.trusted_keys == (env["POLICY_BUNDLE_TRUSTED_KEYS"],)
    assert s.max_inflight == yaml.safe_load(router_config_text())["max_inflight"]
