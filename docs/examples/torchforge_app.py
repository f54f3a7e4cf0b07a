"""Example: a TorchForge-style RL app calibrating INT8 from rollouts it collected, on its own mesh.

TorchForge services are Monarch actors on proc meshes; our ``CalibrationActor`` is one more actor
such an app can spawn next to its generator and trainer. Two routes:

1. In-mesh: spawn ``CalibrationActor`` on the app's procs, send it the rollout token ids it already
   has (tensors in the message; no torchstore needed), get observer state back, merge, convert.
2. File-based: dump the rollouts as ``{"prompt", "completion"}`` JSONL and point a build config's
   ``samples.jsonl`` at it (``policy-bundle build --set samples.jsonl=samples.jsonl ...``).

Run: ``.venv/bin/python docs/examples/torchforge_app.py --out /tmp/forge`` (uses the reference policy).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from policy_bundle.build.calibrate.actor import CalibrationActor
from policy_bundle.build.calibrate.mesh import _import_monarch, shard
from policy_bundle.build.calibrate.samples import calibration_batches, local_samples
from policy_bundle.bundle.info import encode_prompt, load_tokenizer
from policy_bundle.quantize import recipes
from policy_bundle.quantize.calibration import observers
from policy_bundle.quantize.reference import task
from policy_bundle.quantize.model.hf_weights import load_policy
from policy_bundle.quantize.reference.embedded import ensure_reference_policy


def collect_rollouts(policy_dir: Path, n: int) -> list[tuple[str, str, list[int]]]:
    """Stand-in for the RL loop's generator: (prompt, completion, token ids) per episode."""
    policy, tok = load_policy(policy_dir, max_seq_len=32), load_tokenizer(policy_dir)
    prompts = task.rollout_prompts(n)
    ids = [encode_prompt(tok, p) for p in prompts]
    outs = local_samples(policy, ids, 6, tok.eos_token_id)
    return [(p, tok.decode(o, skip_special_tokens=True), i + o) for p, i, o in zip(prompts, ids, outs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--procs", type=int, default=2)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    policy_dir = ensure_reference_policy()
    episodes = collect_rollouts(policy_dir, 64)

    # Route 2 (file-based): the JSONL a build config can name in samples.jsonl.
    with (args.out / "samples.jsonl").open("w") as f:
        for prompt, completion, _ in episodes:
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")

    # Route 1 (in-mesh): the app's own proc mesh, our actor on it.
    monarch = _import_monarch()
    procs = monarch.this_host().spawn_procs(per_host={"procs": args.procs})
    try:
        actors = procs.spawn("int8_calibration", CalibrationActor).flatten("rank")
        recipe = {"scheme": "static", "backend": "x86"}
        batches = calibration_batches([ids for _, _, ids in episodes], 16, 32)
        parts = shard(batches, args.procs)
        for r in range(args.procs):
            actors.slice(rank=r).setup.call_one(r, str(policy_dir), 32, recipe, 1, "", 0).get(timeout=120)
        futures = [actors.slice(rank=r).calibrate.call_one(r, parts[r]) for r in range(len(parts))]
        state = observers.merge_observer_states([f.get(timeout=300) for f in futures])
    finally:
        procs.stop().get(timeout=30)

    rc = recipes.RecipeConfig(**recipe)
    prepared = recipes.prepare(load_policy(policy_dir, max_seq_len=32), rc)
    observers.load_observer_state(prepared, state)
    int8 = recipes.convert(prepared, rc)
    torch.jit.save(torch.jit.script(int8), str(args.out / "policy-int8.ts"))
    print(f"calibrated on {len(episodes)} episodes over {args.procs} actors -> {args.out / 'policy-int8.ts'}")
    print(f"file-based route: {args.out / 'samples.jsonl'} (set samples.jsonl in a build config)")


if __name__ == "__main__":
    main()
