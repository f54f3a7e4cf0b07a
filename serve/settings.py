"""Router settings: an optional YAML file (``POLICY_BUNDLE_ROUTER_CONFIG``), and every setting also from the
environment under one prefix: ``POLICY_BUNDLE_<FIELD>``, a nested one ``POLICY_BUNDLE_<SECTION>__<FIELD>``
(``POLICY_BUNDLE_MAX_INFLIGHT=64``, ``POLICY_BUNDLE_ROLLOUT__STEPS="[1, 5, 100]"``). A variable's value is read as
YAML (a string field takes it as written; ``api_keys`` and ``trusted_keys`` are comma-separated), wins over the file,
and goes through the same checks: an error names the variable, the field and the limit."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple


from policy_bundle.quantize.runtime.decode import DECODE_THREADS
from policy_bundle.quantize.config.schema import (FieldError, choice, config_model, env_mapping, from_mapping, merged,
                                                  ranged, read_as, read_yaml, setting, variable_of)
from policy_bundle.quantize.extras import MissingExtra, require
from policy_bundle.serve.rollout.types import RolloutConfig

INT8_ENGINES = ("torchscript", "vllm")


class SettingsError(ValueError):
    """POLICY_BUNDLE_ROUTER_CONFIG (or an env var) names an unknown field or holds a bad value."""


NO_KEYS = ("holds no key, which would leave every route open; remove it to serve without keys (the router then "
           "says so at each start)")


def _api_keys(path: str, value: Any) -> Tuple[str, ...]:
    """``api_keys``: one key (a YAML string) or a list of them; the error names the type, never a key. Written but
    empty (no value, ``[]``) is refused: keys configured to nothing must not mean open."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        raise FieldError(path, NO_KEYS)
    keys = (value,) if isinstance(value, str) else value
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) and k.strip() for k in keys):
        got = type(value).__name__ if not isinstance(value, (list, tuple)) else \
            f"a list holding {', '.join(sorted({type(k).__name__ for k in value}))}"
        raise FieldError(path, f"must be a non-empty string or a list of non-empty strings (got {got})")
    return tuple(k.strip() for k in keys)


def _paths(path: str, value: Any) -> Tuple[str, ...]:
    """``trusted_keys``: one path or a list of them."""
    paths = (value,) if isinstance(value, str) else value
    if not isinstance(paths, (list, tuple)) or not paths or not all(isinstance(p, str) and p.strip() for p in paths):
        raise FieldError(path, "must be a path or a non-empty list of paths (public key PEM files)")
    return tuple(p.strip() for p in paths)


@config_model("")
class RouterSettings:
    """The router's settings: the keys of POLICY_BUNDLE_ROUTER_CONFIG, each also POLICY_BUNDLE_<FIELD>."""

    state_dir: Path = setting(Path(os.path.expanduser("~/.cache/policy-bundle/router")), help=(
        "where one router keeps its rollout state when state_url is unset"))
    state_url: Optional[str] = setting(None, help=(
        "the rollout database shared by replicas, a SQLAlchemy URL (postgresql+psycopg://user@host/db: the postgres "
        "extra); unset: sqlite:///<state_dir>/rollout.sqlite, one process"))
    admin_token: Optional[str] = setting(None, help="bearer token of the admin API (/admin/*); unset: the admin API is off")
    api_keys: Tuple[str, ...] = read_as(_api_keys, (), help=(
        "bearer keys a client must send (one, or a list; POLICY_BUNDLE_API_KEYS is comma-separated); unset: open, "
        "with a warning at each start; written but empty: refused"))
    trusted_keys: Tuple[str, ...] = read_as(_paths, (), help=(
        "Ed25519 public key files (policy-bundle keygen); set, the router and its variants serve only store entries "
        "whose manifest one of them signed; unset: integrity only"))
    model_name: str = setting("policy", help="the model name the OpenAI endpoints answer to and report")
    sticky_salt: str = setting("policy-bundle", help=(
        "salt of the hash that keeps a user (the body's user, or the x-policy-user header) on one variant while the weight "
        "holds"))
    max_inflight: int = ranged(32, 0, help=(
        "calls in flight (client, shadow, golden); beyond this: 429 with Retry-After"))
    background_slots: int = ranged(2, 0, help="of max_inflight, the most shadow and golden-canary calls at once")
    max_batch: int = ranged(32, 1, help=(
        "sequences the INT8 (TorchScript) engine decodes at once, over all its lanes"))
    prefill_chunk: int = ranged(64, 1, help=(
        "prompt tokens prefilled per decode step while other sequences decode (long prompts)"))
    engine_threads: int = ranged(DECODE_THREADS, 1, 256, help=(
        "intra-op threads of a torch engine's decode thread; the default is what the build's gate decoded with "
        "(another count rounds otherwise, and a row's tokens would depend on its batch)"))
    engine_lanes: int = ranged(0, 0, 256, help=(
        "decode threads (lanes) of a torch engine, each its own batch and KV cache on the one loaded module, "
        "sharing max_batch; 0: one per engine_threads usable cores, at most one per 8 of max_batch"))
    kv_cache_bytes: int = ranged(0, 0, help=(
        "KV-cache bytes a torch engine (INT8 TorchScript, the FP fallback) may hold over all its lanes; a request is "
        "admitted when its worst case (prompt + max_tokens) fits beside the others', else it waits up to kv_wait_s, "
        "then 429 + Retry-After; one that could never fit is a 400 naming max_tokens. 0: the FP16 variant's vLLM "
        "KV space (VLLM_CPU_KVCACHE_SPACE, 1 GiB by default), at most a tenth of the memory limit (at least 256 MiB)"))
    kv_wait_s: float = ranged(20.0, 0.0, help="seconds a request waits for KV-cache room before a 429")
    request_timeout_s: float = ranged(60.0, 0.0, help=(
        "seconds a variant may take to a request's first token and to each next one before the router gives up "
        "on it (a plain call: to the whole answer)"))
    health_interval_s: float = ranged(1.0, 0.0, help=(
        "seconds between variant health probes; a variant that fails one gets no new traffic"))
    health_timeout_s: float = ranged(3.0, 0.0, help=(
        "seconds a health probe may take, and how long a variant may go without a decode step while requests wait "
        "(beyond what its recent steps took): past either, it is down and gets no new traffic"))
    max_body_bytes: int = ranged(65536, 0, help="the largest request body; larger: 413")
    chat_control_tokens: bool = setting(False, help=(
        "a control token's text typed into a chat message (<|im_end|>) is that control token, not text: only for "
        "clients that build turns themselves and are trusted to"))
    require_vllm: bool = setting(False, help="the FP16 variant refuses to start on the fallback engine (no vLLM)")
    int8_engine: str = choice("torchscript", INT8_ENGINES, help=(
        "the INT8 variant's engine: torchscript (the bundle's policy.ts) or vllm (its int8-vllm/ W8A8 directory)"))
    log_format: str = choice("json", ("json", "text"), help=(
        "the service's own log lines: one JSON object each, with the request id, or text"))
    rollout: RolloutConfig = setting(default_factory=RolloutConfig, help="the staged canary rollout of INT8")

    def __post_init__(self) -> None:
        if self.state_url:  # its database driver, now: a replica's first request would fail
            _check_driver(self.state_url)
        for p in self.trusted_keys:  # read now: a key that cannot be read stops start-up, not the first request
            from policy_bundle.bundle.signing import SigningKeyError, load_key

            try:
                load_key(Path(p), private=False)
            except SigningKeyError as exc:
                raise FieldError("trusted_keys", str(exc)) from None


def _check_driver(url: str) -> None:
    """The state URL's SQLAlchemy driver can be imported (``postgresql+psycopg``: the postgres extra)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
        if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() == "psycopg":
            require("postgres", "a postgresql+psycopg URL (rollout state shared by replicas)")
        parsed.get_dialect().import_dbapi()
    except MissingExtra as exc:
        raise FieldError("state_url", str(exc)) from None
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise FieldError("state_url", f"is not a SQLAlchemy database URL ({exc})") from None
    except ImportError as exc:
        raise FieldError("state_url", f"its driver cannot be imported ({exc})") from None


def _env_list(env: Mapping[str, str], name: str, empty: str) -> Tuple[str, ...]:
    """A comma-separated variable's items; set to none of them is refused (``empty`` says why), never read as unset."""
    items = tuple(k.strip() for k in env[name].split(",") if k.strip())
    if not items:
        raise FieldError(name, f"is set but {empty}")
    return items


ENV_PREFIX = "POLICY_BUNDLE_"
CONFIG_ENV = "POLICY_BUNDLE_ROUTER_CONFIG"
OLD_CONFIG_ENV = "POLICY_ROUTER_CONFIG"  # the file's variable before it took the prefix: still read, with a warning
_warned_old_name: list = []
ENV_LISTS = {"api_keys": NO_KEYS, "trusted_keys": "names no key file (unset it to serve unsigned bundles)"}


def env_settings(env: Mapping[str, str]) -> Tuple[dict, Dict[str, str]]:
    """What the environment sets, as the settings file's mapping would hold it, and the variable behind each dotted
    field path. ``api_keys``/``trusted_keys`` are comma-separated, and set to no item is refused, not unset."""
    readers = {name: (lambda var, raw, why=why: list(_env_list({var: raw}, var, why))) for name, why in ENV_LISTS.items()}
    return env_mapping(RouterSettings, ENV_PREFIX, dict(env), readers)


def config_path(env: Mapping[str, str]) -> Optional[str]:
    """The settings file: ``POLICY_BUNDLE_ROUTER_CONFIG``, else the old ``POLICY_ROUTER_CONFIG`` (with a warning)."""
    if env.get(CONFIG_ENV):
        return env[CONFIG_ENV]
    if env.get(OLD_CONFIG_ENV):
        if not _warned_old_name:
            _warned_old_name.append(True)  # once per process: the settings are read at each service's start
            logging.getLogger("policy_bundle.router").warning("%s is the old name of %s; it still works",
                                                              OLD_CONFIG_ENV, CONFIG_ENV)
        return env[OLD_CONFIG_ENV]
    return None


def load_settings() -> RouterSettings:
    """Settings from the file and the environment; SettingsError names the field that is wrong (and the variable,
    when one set it)."""
    source: Dict[str, str] = {}
    try:
        path = config_path(os.environ)
        data = read_yaml(Path(path), CONFIG_ENV) if path else {}
        over, source = env_settings(os.environ)
        return from_mapping(RouterSettings, merged(data, over))
    except FieldError as exc:  # the gate thresholds' and the rollout's own checks included
        var = variable_of(exc.path, source)
        raise SettingsError(f"{var}: {exc}" if var else str(exc)) from None


def settings_or_exit() -> RouterSettings:
    """``load_settings`` for a server's start-up: a bad setting is one log line and exit, not a traceback."""
    try:
        return load_settings()
    except SettingsError as exc:
        logging.getLogger("policy_bundle.router").error("refusing to start: %s", exc)
        raise SystemExit(f"policy-bundle: {exc}") from None


def router_schema() -> dict:
    """The router settings file's JSON Schema (``policy-bundle config schema router``)."""
    from policy_bundle.quantize.config.json_schema import json_schema

    return json_schema(RouterSettings, "policy-bundle router settings (POLICY_BUNDLE_ROUTER_CONFIG)")


ROUTER_DEFAULTS_HEADER = """Every router setting at its default, with its type and limit (`policy-bundle config defaults router`): the
keys of POLICY_BUNDLE_ROUTER_CONFIG, each also POLICY_BUNDLE_<FIELD> (nested: POLICY_BUNDLE_<SECTION>__<FIELD>)."""


if __name__ == "__main__":  # the CLI (build/) runs this as a process: build/ never imports serve/
    import json
    import sys

    if sys.argv[1:] == ["--defaults"]:
        from policy_bundle.quantize.config.json_schema import defaults_yaml

        print(defaults_yaml(RouterSettings, ROUTER_DEFAULTS_HEADER), end="")
    else:
        print(json.dumps(router_schema(), indent=2))
