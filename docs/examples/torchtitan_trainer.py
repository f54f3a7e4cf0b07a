"""Example: the TorchForge-shaped flow on CPU: a Monarch actor trains a torchtitan model, the build takes its checkpoint.

The trainer actor builds torchtitan's llama3 model (the ``policy-bundle-reference`` flavor, sized to the
reference task's vocabulary), trains it with torchtitan's AdamW container, LR scheduler and cross-entropy
loss on the reference task's data, and saves the full training state (model + optimizer + scheduler)
with torchtitan's ``CheckpointManager``: a DCP ``checkpoint/step-N`` directory, as a TorchForge trainer
writes it. ``build/configs/torchtitan.yaml`` then builds a bundle from that directory.

Why not torchtitan's ``Trainer``: on a CPU-only torch, ``torchtitan.tools.utils.device_type`` falls back
to ``"cuda"`` and ``Trainer.__init__`` calls ``torch.cuda.set_device`` (AttributeError: no
``_cuda_setDevice``); its language-model attention backends are FlexAttention (no backward on CPU) or
varlen (CUDA). So the actor runs torchtitan's model, optimizer, scheduler, loss and checkpointer in a
small loop of its own, with torchtitan's causal SDPA attention.

Run: ``.venv/bin/python docs/examples/torchtitan_trainer.py --out /tmp/titan --steps 60``, then
``.venv/bin/policy-bundle build --config build/configs/torchtitan.yaml --set policy.source=<printed step dir>
--out bundles/titan``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any, Dict, List

import torch
from monarch.actor import Actor, endpoint

from policy_bundle.quantize.reference import task


class TorchtitanTrainerActor(Actor):
    """One trainer process; sync endpoints only (Monarch refuses actors that mix sync and async)."""

    def __init__(self) -> None:
        self.model = None

    @endpoint
    def train(self, out_dir: str, steps: int, seed: int = 0, batch_size: int = 32, lr: float = 3e-3,
              threads: int = 1, save_every: int = 0) -> Dict[str, Any]:
        """Train ``steps`` steps and save ``out_dir/checkpoint/step-<steps>`` (and every ``save_every`` steps
        before it, as a trainer the drift monitor watches does); returns the last one's path and the losses."""
        import torch.distributed as dist
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

        from policy_bundle.build.source.torchtitan_checkpoint import REFERENCE_FLAVOR, model_spec

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        if not dist.is_initialized():  # the checkpointer asks for the rank; a one-rank gloo group, as TorchForge has
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        spec = model_spec("llama3", REFERENCE_FLAVOR)
        with torch.device("meta"):
            model = spec.model.build()
        model.to_empty(device="cpu")
        model.init_states(buffer_device=torch.device("cpu"))
        optimizers = default_adamw(lr=lr).build(model_parts=[model])
        schedulers = LRSchedulersContainer.Config(warmup_steps=max(1, steps // 10)).build(
            optimizers=optimizers, training_steps=steps)
        loss_fn = CrossEntropyLoss.Config().build()
        folder = str(Path(out_dir) / "checkpoint")
        checkpointer = CheckpointManager.Config(enable=True, folder=folder, interval=save_every or steps,
                                                last_save_model_only=False).build(
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers, states={},
            sd_adapter=None)
        rng, losses = random.Random(seed), []
        for step in range(1, steps + 1):
            inputs, labels = task_batch(rng, batch_size)
            loss, _ = loss_fn(model(inputs), labels)
            loss = loss / (labels != -100).sum()
            optimizers.zero_grad()
            loss.backward()
            optimizers.step()
            schedulers.step()
            losses.append(float(loss.detach()))
            checkpointer.save(step, last_step=step == steps)
        checkpointer.close()
        self.model = model.eval()
        return {"checkpoint": str(Path(folder) / f"step-{steps}"), "losses": losses}

    @endpoint
    def logits(self, tokens: List[List[int]]) -> torch.Tensor:
        """torchtitan's forward of the trained model on ``tokens`` (the reference for our converted policy)."""
        with torch.no_grad():
            return self.model(torch.tensor(tokens))


def task_batch(rng: random.Random, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels from the reference task (held-out golden prompts excluded); only the answer and
    its EOS are labelled, the rest is torchtitan's ignore index (-100)."""
    from policy_bundle.quantize.reference.embedded import _batch

    golden = frozenset(i.prompt for i in task.golden_set(1000))
    items = []
    while len(items) < batch_size:
        it = task.make_item(rng, 3)
        if it.prompt not in golden:
            items.append(it)
    ids, mask = _batch(items, task.build_tokenizer())
    labels = torch.where(mask[:, 1:] > 0, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    return ids[:, :-1], labels


def train_on_mesh(out: Path, steps: int, save_every: int = 0) -> tuple[Dict[str, Any], Any, Any]:
    """Spawn one trainer process, train; returns (the train result, the actor, the proc mesh to stop)."""
    from policy_bundle.build.calibrate.mesh import _import_monarch

    procs = _import_monarch().this_host().spawn_procs(per_host={"procs": 1})
    trainer = procs.spawn("torchtitan_trainer", TorchtitanTrainerActor)
    result = trainer.train.call_one(str(out), steps, save_every=save_every).get(timeout=300)
    return result, trainer, procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: only the last)")
    args = ap.parse_args()
    if args.steps < 1 or args.save_every < 0:
        ap.error(f"--steps must be >= 1 and --save-every >= 0 (got {args.steps}, {args.save_every})")
    args.out.mkdir(parents=True, exist_ok=True)
    result, _, procs = train_on_mesh(args.out.resolve(), args.steps, args.save_every)
    procs.stop().get(timeout=30)
    print(f"trained {args.steps} steps (loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}); "
          f"checkpoint {result['checkpoint']}")
    print(f"build: policy-bundle build --config build/configs/torchtitan.yaml "
          f"--set policy.source={result['checkpoint']} --out bundles/titan")


if __name__ == "__main__":
    main()
