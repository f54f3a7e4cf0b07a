"""The ``policy-bundle`` command: build, verify, gate, check-fp16, watch, containerize. Errors become one line and a non-zero exit."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import List, Optional

from policy_bundle.build.errors import (EXIT_ERROR, EXIT_GATE, EXIT_INTERRUPTED, EXIT_OK, EXIT_REFUSED, GateError,
                                        expected_errors)


def _quiet_runtime() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def cmd_build(args: argparse.Namespace) -> int:
    from policy_bundle.build.config.build_config import load_config
    from policy_bundle.build.pipeline import run_build

    cfg = load_config(Path(args.config) if args.config else None, tuple(args.set or ()), env=os.environ)
    result = run_build(cfg, Path(args.out), force=args.force)
    fid = result.fidelity["int8_torchscript"]
    print(f"bundle: {result.bundle}")
    print(f"manifest sha256: {result.manifest_sha256}")
    if result.int8_tag:
        print(f"model store: {result.int8_tag}  {result.fp16_tag}")
    print(f"INT8 vs FP32: top-1 agreement {fid['top1_agreement']:.4f}, KL mean {fid['kl_mean']:.5f}"
          + (f", reward {fid['reward_reference']:.3f} -> {fid['reward_candidate']:.3f}"
             if fid.get("reward_candidate") is not None else ""))
    f16 = result.fidelity.get("fp16_hf")
    if f16:
        print(f"FP16 vs FP32: top-1 agreement {f16['top1_agreement']:.4f}, KL mean {f16['kl_mean']:.5f}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from policy_bundle.build.containerize.bento_models import is_bento, verify_bento_models
    from policy_bundle.bundle.layout import BundleLayout
    from policy_bundle.bundle.manifest import verify_bundle

    keys = [Path(k) for k in args.key or ()]
    if is_bento(Path(args.bundle)):
        for model in verify_bento_models(Path(args.bundle), keys):
            print(f"ok: {model.tag} matches its manifest (sha256 {model.manifest_sha256})"
                  + (", signed by a trusted key" if keys else ""))
        return 0
    n = verify_bundle(Path(args.bundle))
    signed = ""
    if keys:
        from policy_bundle.bundle.signing import verify_signature

        signed = f", signed by trusted key {verify_signature(Path(args.bundle), keys)}"
    print(f"ok: {n} files match {BundleLayout(args.bundle).manifest}{signed}")
    return 0


BUILD_DEFAULTS_HEADER = """The build config's reference: every key at its default, its help above it, its type and limit after it. Made by
`policy-bundle config defaults build` from the config models (a test checks it is current and reads back to the
defaults). Copy the keys you change into your own config; a null is resolved at build time from the policy
(docs/build.md). The main job's config is build/configs/main.yaml."""


def _router_settings_output(what: str, *args: str) -> int:
    """Print what ``python -m policy_bundle.serve.settings ARGS`` prints: the router's settings live in serve/, which
    build/ never imports, so it answers in a process of its own."""
    import subprocess

    res = subprocess.run([sys.executable, "-m", "policy_bundle.serve.settings", *args], capture_output=True, text=True)
    if res.returncode != 0:
        print(f"error: the router settings' {what}: {res.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return EXIT_ERROR
    print(res.stdout, end="")
    return EXIT_OK


def cmd_config_defaults(args: argparse.Namespace) -> int:
    """Every key of the build config or the router settings at its default, as YAML with its limits as comments."""
    if args.what == "router":
        return _router_settings_output("defaults", "--defaults")
    from policy_bundle.build.config.build_config import BuildConfig
    from policy_bundle.quantize.config.json_schema import defaults_yaml

    print(defaults_yaml(BuildConfig, BUILD_DEFAULTS_HEADER), end="")
    return EXIT_OK


def cmd_config_schema(args: argparse.Namespace) -> int:
    """The JSON Schema of the build config or the router settings: the keys, types, limits and defaults the readers
    enforce (``quantize.config.json_schema.json_schema``), for editors and CI checks of a config file."""
    import json

    if args.what == "router":
        return _router_settings_output("schema")
    from policy_bundle.build.config.build_config import BuildConfig
    from policy_bundle.quantize.config.json_schema import json_schema

    print(json.dumps(json_schema(BuildConfig, "policy-bundle build config"), indent=2))
    return EXIT_OK


def cmd_rollout(args: argparse.Namespace) -> int:
    from policy_bundle.build.rollout_client import AdminClient, RouterUnreachable, run

    try:
        lines = run(args.rollout_command, AdminClient.from_args(args.url, args.token), args.reason, args.weight,
                    args.limit)
    except RouterUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print("\n".join(lines))
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from policy_bundle.bundle.signing import generate_key, key_id, load_key

    pub = generate_key(Path(args.out))
    print(f"private key: {args.out} (keep it secret: the build signs with it, POLICY_BUNDLE_SIGNING_KEY)")
    print(f"public key: {pub} (key {key_id(load_key(pub, private=False))}; routers trust it, POLICY_BUNDLE_TRUSTED_KEYS)")
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    from policy_bundle.bundle.manifest import verify_bundle
    from policy_bundle.bundle.signing import sign_bundle

    verify_bundle(Path(args.bundle))  # never sign files that do not match their manifest
    print(f"signed: {Path(args.bundle) / 'bundle.json.sig'} (key {sign_bundle(Path(args.bundle), Path(args.key))}); "
          "register the bundle again for the store entries to carry it")
    return 0


def cmd_check_fp16(args: argparse.Namespace) -> int:
    from policy_bundle.build.artifacts.fp16check import check_fp16

    res = check_fp16(Path(args.bundle), args.engine)
    ok = res.greedy_agreement >= args.min_agreement
    print(f"{'ok' if ok else 'FAIL'}: FP16 via {res.engine}: greedy outputs equal FP32 on "
          f"{res.greedy_agreement:.1%} of {res.items} golden prompts (minimum {args.min_agreement:.0%})")
    return EXIT_OK if ok else EXIT_GATE


def cmd_gate(args: argparse.Namespace) -> int:
    if args.command == "canary":
        print("policy-bundle: `policy-bundle canary` is now `policy-bundle gate` (the old name works, and will be "
              "dropped)", file=sys.stderr)
    from policy_bundle.build.config.build_config import config_from_dict
    from policy_bundle.build.gate.report import metrics_table
    from policy_bundle.build.gate.measure import fidelity_kwargs
    from policy_bundle.bundle.info import load_tokenizer, read_golden_jsonl
    from policy_bundle.bundle.layout import BundleLayout
    from policy_bundle.bundle.manifest import read_manifest, verified_artifact, verify_bundle
    from policy_bundle.quantize.fidelity.scores import evaluate_gate, measure_fidelity
    from policy_bundle.quantize.model.hf_weights import load_policy

    bundle = Path(args.bundle)
    layout = BundleLayout(bundle)
    verify_bundle(bundle)
    manifest = read_manifest(bundle)
    artifact = verified_artifact(bundle, manifest, "int8_torchscript")  # what serving checks, before any load
    cfg = config_from_dict(manifest["config"], tuple(args.set or ()))
    source = Path(manifest["policy"]["source"])
    if not (source / "config.json").is_file():
        print(f"note: FP32 source {source} is gone; using the bundle's FP16 weights upcast to FP32 as reference")
        source = layout.fp16_dir
    from policy_bundle.quantize.runtime.script_runner import load_torchscript

    reference = load_policy(source, max_seq_len=cfg.policy.max_seq_len)
    candidate = load_torchscript(artifact)
    golden = read_golden_jsonl(layout.golden)
    report = measure_fidelity(reference, candidate, golden, **fidelity_kwargs(cfg, load_tokenizer(layout.int8_dir)))
    verdict = evaluate_gate(report, cfg.gate.thresholds)
    print(metrics_table([("INT8 vs FP32", report.summary())]))
    for note in report.notes:
        print(f"note: {note}")
    print(f"verdict: {verdict.label.upper()}" + (f" ({'; '.join(verdict.failures)})" if verdict.failures else ""))
    return EXIT_OK if verdict.passed else EXIT_GATE


def cmd_watch(args: argparse.Namespace) -> int:
    from policy_bundle.build.watch.monitor import WatchOptions, watch

    bundle = Path(args.bundle)
    return watch(WatchOptions(bundle=bundle, checkpoints=Path(args.checkpoints),
                              out_root=Path(args.out_root) if args.out_root else bundle.resolve().parent,
                              every_steps=args.every_steps, threshold=args.threshold, poll_s=args.poll_s,
                              once=args.once, sets=tuple(args.set or ()), reset=args.reset,
                              max_retries=args.max_retries, keep=args.keep))


def cmd_serve(args: argparse.Namespace) -> int:
    """``bentoml serve`` of the router (its variants start with it), in this process: signals reach it as they would."""
    import os

    env = dict(os.environ)
    if args.bundle_version:
        env["POLICY_BUNDLE_VERSION"] = args.bundle_version
    if args.config:
        config = Path(args.config)
        if not config.is_file():
            raise FileNotFoundError(f"--config: {config} is not a file")
        env["POLICY_BUNDLE_ROUTER_CONFIG"] = str(config.resolve())
    cmd = [sys.executable, "-m", "bentoml", "serve", "policy_bundle.serve.router.service:PolicyRouter",
           "--host", args.host, "--port", str(args.port)]
    sys.stdout.flush()
    os.execve(sys.executable, cmd, env)
    return 0  # not reached: the server replaces this process


def cmd_containerize(args: argparse.Namespace) -> int:
    from policy_bundle.build.containerize.bentofile import default_torch_wheel
    from policy_bundle.build.containerize.image import ContainerizeOptions, containerize

    wheel = Path(args.torch_wheel) if args.torch_wheel else default_torch_wheel()
    built = containerize(ContainerizeOptions(context=Path(args.context).resolve(), bento=args.bento,
                                             tags=tuple(args.tag or ()), rebuild_base=args.rebuild_base,
                                             torch_wheel=wheel))
    print(f"image: {built.image} ({built.size_bytes / 1e9:.2f} GB) from bento {built.bento}")
    print(f"run: podman run --rm --network host --shm-size 1g -e POLICY_BUNDLE_API_KEYS=<key> "
          f"-v policy-bundle-state:/home/bentoml/state {built.image} --port 3000")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="policy-bundle", description="Turn a trained policy into a verified INT8 + FP16 "
                                "bundle, and operate its served rollout.", epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = _Subcommands(p.add_subparsers(dest="command", required=True))

    b = sub.add_parser("build", parents=[common], help="build a bundle from a config")
    b.add_argument("--config", help="build config YAML (e.g. build/configs/main.yaml)")
    b.add_argument("--out", required=True, help="bundle directory to create")
    b.add_argument("--force", action="store_true", help="replace an existing output directory")
    b.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. calibration.procs=2")
    b.set_defaults(func=cmd_build)

    v = sub.add_parser("verify", parents=[common],
                       help="re-hash every bundle file against bundle.json (a bento: every model it carries)")
    v.add_argument("bundle", help="a bundle directory, or a bento directory (/home/bentoml/bento in the image)")
    v.add_argument("--key", action="append", metavar="PUBLIC_KEY",
                   help="also require the manifest signed by this public key (repeatable: any of them)")
    v.set_defaults(func=cmd_verify)

    cf = sub.add_parser("config", parents=[common], help="print a config file's JSON Schema (build or router)")
    cfs = cf.add_subparsers(dest="config_command", required=True)
    sc = cfs.add_parser("schema", parents=[common], help="the JSON Schema: keys, types, limits, defaults, help",
                        description="The JSON Schema (draft 2020-12) of a build config (policy-bundle build --config) "
                                    "or of the router settings file (POLICY_BUNDLE_ROUTER_CONFIG).")
    sc.add_argument("what", choices=["build", "router"], help="which file's schema")
    sc.set_defaults(func=cmd_config_schema)
    dc = cfs.add_parser("defaults", parents=[common], help="every key with its default, type, limit and help, as YAML",
                        description="A config file holding every key at its default, its help as comment lines "
                                    "above it and its type and limit after it (build/configs/reference.yaml is the "
                                    "build's, made by this).")
    dc.add_argument("what", choices=["build", "router"], help="which file's defaults")
    dc.set_defaults(func=cmd_config_defaults)

    r = sub.add_parser("rollout", parents=[common],
                       help="operate the served rollout over the router's admin API (status, history, promote, ...)",
                       description="Operate a served rollout: the router's URL and admin token from --url/--token or "
                                   "POLICY_BUNDLE_URL / POLICY_BUNDLE_ADMIN_TOKEN. A refused command is one line and "
                                   "exit 3; a router that cannot be reached, exit 1.")
    from policy_bundle.build.rollout_client import COMMANDS, DEFAULT_URL

    r.add_argument("rollout_command", choices=COMMANDS, metavar="COMMAND", help=" | ".join(COMMANDS))
    r.add_argument("weight", nargs="?", type=float, help="set-weight: the INT8 weight in %% (0-100)")
    r.add_argument("--url", help=f"the router (default: POLICY_BUNDLE_URL, else {DEFAULT_URL})")
    r.add_argument("--token", help="the admin token (default: POLICY_BUNDLE_ADMIN_TOKEN)")
    r.add_argument("--reason", default="policy-bundle rollout", help="recorded in the rollout's history")
    r.add_argument("--limit", type=int, default=20, help="history: the newest N events (default 20)")
    r.set_defaults(func=cmd_rollout)

    g = sub.add_parser("keygen", parents=[common], help="make an Ed25519 signing key and its public key (.pub)")
    g.add_argument("--out", required=True, help="the private key file to write (the public key goes beside it)")
    g.set_defaults(func=cmd_keygen)

    s = sub.add_parser("sign", parents=[common], help="sign a built bundle's manifest (bundle.json.sig)")
    s.add_argument("bundle", help="the bundle directory")
    s.add_argument("--key", required=True, help="the private key (policy-bundle keygen)")
    s.set_defaults(func=cmd_sign)

    c = sub.add_parser("gate", aliases=["canary"], parents=[common],
                       help="re-run the accuracy gate on a bundle (exit 0 pass, 4 fail; `canary` is its old name)")
    _bundle_argument(c, "the bundle directory")
    c.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a threshold, e.g. gate.max_kl_mean=0.01")
    c.set_defaults(func=cmd_gate)

    w = sub.add_parser("watch", parents=[common],
                       help="rebuild the bundle when a newer training checkpoint's calibration drifts")
    _bundle_argument(w, "the deployed bundle directory")
    w.add_argument("--checkpoints", required=True, help="directory the trainer writes step-N checkpoints into")
    w.add_argument("--out-root", help="where new bundles and watch-state.json go (default: beside BUNDLE)")
    w.add_argument("--every-steps", type=int, default=1000, help="check a checkpoint this many steps after the last")
    w.add_argument("--threshold", type=float, default=0.05, help="rebuild when a layer drifts by more than this")
    w.add_argument("--poll-s", type=float, default=30.0, help="seconds between looks at --checkpoints")
    w.add_argument("--once", action="store_true", help="one pass, then exit")
    w.add_argument("--reset", action="store_true", help="forget --out-root's watch-state.json, start from BUNDLE")
    w.add_argument("--max-retries", type=int, default=5,
                   help="failed checks (or builds that may pass) of one checkpoint before it is given up (default 5)")
    w.add_argument("--keep", type=int, default=0,
                   help="bundles the monitor built to keep, on disk and in the model store (default 0: all)")
    w.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a build field for checks and rebuilds")
    w.set_defaults(func=cmd_watch)

    sv = sub.add_parser("serve", parents=[common], help="serve the registered bundle pair: the router and both variants "
                        "(bentoml serve policy_bundle.serve.router.service:PolicyRouter)")
    sv.add_argument("--host", default="0.0.0.0", help="address to listen on")
    sv.add_argument("--port", type=int, default=3000, help="port to listen on")
    sv.add_argument("--bundle-version", help="the store version to serve (POLICY_BUNDLE_VERSION; default: the newest "
                    "whole pair)")
    sv.add_argument("--config", help="router settings YAML (POLICY_BUNDLE_ROUTER_CONFIG)")
    sv.set_defaults(func=cmd_serve)

    k = sub.add_parser("containerize", parents=[common],
                       help="`bentoml build` + `bentoml containerize --backend podman` on a local Debian base image")
    k.add_argument("--bento", help="containerize this bento tag (default: `bentoml build` one from bentofile.yaml)")
    k.add_argument("--tag", action="append", metavar="NAME:TAG", help="another tag for the image (repeatable)")
    k.add_argument("--context", default=".", help="the checkout holding bentofile.yaml (default: .)")
    k.add_argument("--torch-wheel", help="the torch 2.13.0+cpu wheel to ship in the bento (default: that wheel in pip's "
                   "find-links, PIP_FIND_LINKS, if there; else the image installs torch from PyTorch's CPU index)")
    k.add_argument("--rebuild-base", action="store_true", help="rebuild the base image even if it exists")
    k.set_defaults(func=cmd_containerize)

    f = sub.add_parser("check-fp16", parents=[common], help="greedy FP16 (transformers or vLLM) vs FP32 on the golden set")
    f.add_argument("bundle", help="a built bundle directory")
    f.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="what runs the FP16 directory")
    f.add_argument("--min-agreement", type=float, default=0.95,
                   help="the greedy agreement with FP32 below which it exits 4")
    f.set_defaults(func=cmd_check_fp16)
    return p


EXIT_CODES = """exit codes: 0 done (a build or gate run that passed); 1 an unexpected error (its type; --debug for
the traceback), or a router that cannot be reached; 2 a usage error (flags, arguments); 3 an input or state refused
with one line naming it (a config field and its limit, a file, a key, a signature, a router's refusal, a failed mesh
shard; watch --once: the checkpoint's check or rebuild failed); 4 the accuracy gate failed (the build's gate, the
exported TorchScript's, gate's verdict, check-fp16 under --min-agreement); 130 interrupted"""


class _DefaultsShown(argparse.HelpFormatter):
    """Every option's default in its help, where it has one (not None, not a flag's False, not already said)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


class _Subcommands:
    """``add_parser`` with the subcommand's help as its description and every default shown in its ``--help``."""

    def __init__(self, action):
        self.action = action

    def add_parser(self, name: str, **kwargs):
        kwargs.setdefault("description", kwargs.get("help"))
        return self.action.add_parser(name, formatter_class=_DefaultsShown, **kwargs)


def _bundle_argument(p: argparse.ArgumentParser, help_text: str) -> None:
    """BUNDLE as a positional, as every subcommand takes it; ``--bundle`` still read (earlier scripts)."""
    p.add_argument("bundle", nargs="?", help=help_text)
    p.add_argument("--bundle", dest="bundle_option", help=argparse.SUPPRESS)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("policy-bundle")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if hasattr(args, "bundle_option"):
        if args.bundle and args.bundle_option and args.bundle != args.bundle_option:
            p.error(f"BUNDLE given twice ({args.bundle} and --bundle {args.bundle_option})")
        args.bundle = args.bundle or args.bundle_option
        if not args.bundle:
            p.error(f"{args.command}: BUNDLE is required")
    _quiet_runtime()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the CLI boundary turns errors into one line
        if args.debug:
            raise
        if isinstance(exc, GateError):
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_GATE
        if isinstance(exc, expected_errors()):  # the message is the whole story: no traceback
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_REFUSED
        print(f"error ({type(exc).__name__}): {exc}\n(run with --debug for the traceback)", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
