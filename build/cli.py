"""The ``policy-bundle`` command: build, verify, canary. Errors become one line and a non-zero exit."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import List, Optional

# Expected failures: their message is the whole story, so no traceback (unless --debug).
USER_ERRORS = ("ConfigError", "RecipeError", "UnsupportedModelError", "BundleExistsError",
               "BundleVerificationError", "CanaryGateError", "MeshError", "FileNotFoundError")


def _quiet_runtime() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def cmd_build(args: argparse.Namespace) -> int:
    from build.config import load_config
    from build.pipeline import run_build

    cfg = load_config(Path(args.config) if args.config else None, tuple(args.set or ()))
    result = run_build(cfg, Path(args.out), force=args.force)
    fid = result.fidelity["int8_torchscript"]
    print(f"bundle: {result.bundle}")
    print(f"manifest sha256: {result.manifest_sha256}")
    if result.int8_tag:
        print(f"model store: {result.int8_tag}  {result.fp16_tag}")
    print(f"INT8 vs FP32: top-1 agreement {fid['top1_agreement']:.4f}, KL mean {fid['kl_mean']:.5f}"
          + (f", reward {fid['reward_reference']:.3f} -> {fid['reward_candidate']:.3f}"
             if fid.get("reward_candidate") is not None else ""))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from build.manifest import verify_bundle

    n = verify_bundle(Path(args.bundle))
    print(f"ok: {n} files match {Path(args.bundle) / 'bundle.json'}")
    return 0


def cmd_check_fp16(args: argparse.Namespace) -> int:
    from build.fp16check import check_fp16

    res = check_fp16(Path(args.bundle), args.engine)
    ok = res.greedy_agreement >= args.min_agreement
    print(f"{'ok' if ok else 'FAIL'}: FP16 via {res.engine}: greedy outputs equal FP32 on "
          f"{res.greedy_agreement:.1%} of {res.items} golden prompts (minimum {args.min_agreement:.0%})")
    return 0 if ok else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="policy-bundle", description="Turn a trained policy into a verified INT8 + FP16 bundle.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", parents=[common], help="build a bundle from a config")
    b.add_argument("--config", help="build config YAML (e.g. build/configs/reference.yaml)")
    b.add_argument("--out", required=True, help="bundle directory to create")
    b.add_argument("--force", action="store_true", help="replace an existing output directory")
    b.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. calibration.procs=2")
    b.set_defaults(func=cmd_build)

    v = sub.add_parser("verify", parents=[common], help="re-hash every bundle file against bundle.json")
    v.add_argument("bundle")
    v.set_defaults(func=cmd_verify)

    f = sub.add_parser("check-fp16", parents=[common], help="greedy FP16 (transformers or vLLM) vs FP32 on the golden set")
    f.add_argument("bundle")
    f.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    f.add_argument("--min-agreement", type=float, default=0.95)
    f.set_defaults(func=cmd_check_fp16)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    _quiet_runtime()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI boundary turns errors into one line
        if args.debug:
            raise
        name = type(exc).__name__
        kind = "error" if name in USER_ERRORS else f"error ({name})"
        print(f"{kind}: {exc}", file=sys.stderr)
        if name not in USER_ERRORS:
            print("(run with --debug for the traceback)", file=sys.stderr)
        return 2 if name in USER_ERRORS else 1


if __name__ == "__main__":
    sys.exit(main())
