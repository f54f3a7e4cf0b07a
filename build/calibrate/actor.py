"""The calibration actor: one process's share of rollouts and calibration on the Monarch mesh.

Imported only where Monarch runs (the controller and the mesh processes); ``quantize/`` never
imports Monarch.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch
from monarch.actor import Actor, current_rank, endpoint
from torch import Tensor

from policy_bundle.build.build_faults import ShardFaults
from policy_bundle.quantize import recipes
from policy_bundle.quantize.calibration import observers

class CalibrationActor(Actor):
    """Maps the policy's weights when an endpoint needs the whole model (rollouts, observers) and lets
    go of them on ``release``; the w8a8 pipeline maps only its share of the layers. All endpoints are sync (Monarch
    refuses mixed actors)."""

    def __init__(self) -> None:
        self._policy = self._prepared = self.tok = None
        self._layers = None  # (layer indices, a share of the policy with only those layers' weights mapped)
        self._plans: Dict[str, Any] = {}  # a share's plan in progress (``plan_share``), by the controller's key
        self.faults = ShardFaults("", 0, 0)  # the test faults this actor runs under (set up by ``setup``)
        self.generation = 0

    @endpoint
    def setup(self, rank: int, policy_dir: str, max_seq_len: int, recipe: Dict[str, Any], threads: int,
              fault: str, generation: int) -> Dict[str, int]:
        """Remember where the policy is (its weights are mapped when first needed). ``rank`` is the controller's
        worker number (the Monarch rank of a one-actor slice is always 0)."""
        torch.set_num_threads(threads)
        self.policy_dir, self.max_seq_len = policy_dir, max_seq_len
        self.recipe = recipes.RecipeConfig(**recipe)
        self.smoothing: Optional[Dict[str, Tensor]] = None
        self.rank, self.faults, self.generation = rank, ShardFaults(fault, rank, generation), generation
        return {"rank": rank, "mesh_rank": current_rank().rank, "pid": os.getpid()}

    @property
    def policy(self):
        """The whole policy, its weights memory-mapped (``hf_weights.load_policy``) on first use."""
        if self._policy is None:
            from policy_bundle.quantize.model.hf_weights import load_policy

            self._policy = load_policy(self.policy_dir, max_seq_len=self.max_seq_len)
        return self._policy

    @property
    def prepared(self):
        """The policy with the recipe's observers (smoothed first where the controller said so), made on first use."""
        if self._prepared is None:
            from policy_bundle.quantize.calibration.smooth import apply_smoothing

            base = self.policy if self.smoothing is None else apply_smoothing(self.policy, self.smoothing)
            self._prepared = recipes.prepare(base, self.recipe)
        return self._prepared

    @endpoint
    def release(self) -> bool:
        """Let go of the whole model and everything made from it: its pages leave this process."""
        self._policy = self._prepared = self._layers = None
        self._plans = {}
        _return_freed_memory()
        return True

    def _share(self, layers: List[int]):
        """A share of the decoder layers, only those weights mapped; kept while the share is being planned."""
        from policy_bundle.quantize.model.hf_weights import load_policy

        if self._layers is None or self._layers[0] != tuple(layers):
            self._layers = (tuple(layers), load_policy(self.policy_dir, max_seq_len=self.max_seq_len, layers=layers))
        return self._layers[1]

    @endpoint
    def forward_layers(self, shard: int, layers: List[int], hidden: List[Tensor]) -> List[Tensor]:
        """A share's float output from its input (the next share's input), the share's weights mapped for its plan."""
        from policy_bundle.quantize.calibration.layer_stream import run_layer

        self.faults.check(shard, 0)
        share = self._share(layers)
        with torch.no_grad():
            for i in layers:
                hidden = run_layer(share, i, hidden)
        return hidden

    @endpoint
    def plan_share(self, shard: int, key: str, layers: List[int], hidden: List[Tensor], recipe, upto: int):
        """The w8a8 plan of ``layers[:upto]`` of a share (``quantize.w8a8.stream.plan_layers``), from the share's input
        ``hidden``, continuing where this actor's last call on the share (``key``) stopped; an actor that has not seen
        the share (a re-run after a crash) starts it from its input. Returns the layers done, and with the last
        (plan, statistics kept, the share's output): the last share's output is the head's input, kept by the
        controller to plan another candidate's head without streaming the layers again."""
        from policy_bundle.quantize.w8a8.stream import PlanPart, absorb_part, plan_layers

        state = self._plans.get(key)
        if state is None or state["done"] >= upto:
            state = self._plans[key] = {"done": 0, "part": None, "hidden": hidden}
        share = self._share(layers)
        todo = list(layers[state["done"]:upto])
        for j in range(len(todo)):
            self.faults.check(shard, state["done"] + j)
        part: PlanPart = plan_layers(share, todo, state["hidden"], recipe)
        state["part"] = part if state["part"] is None else absorb_part(state["part"], part)
        state["hidden"], state["done"] = part.hidden, upto
        _return_freed_memory()  # the layer's Hessians and temporaries
        if upto < len(layers):
            return upto, None
        done = self._plans.pop(key)["part"]
        self._layers = None
        return upto, (done.plan, done.stats, done.hidden)

    @endpoint
    def samples(self, shard: int, prompt_ids: List[List[int]], max_new_tokens: int,
                 eos: Optional[int], engine: str, batch_size: int = 16) -> List[List[int]]:
        from policy_bundle.quantize.runtime.decode import greedy_generate_batch

        if engine == "vllm":  # one engine per actor, on this actor's share of the prompts
            from policy_bundle.build.calibrate.samples import vllm_samples

            self.faults.check(shard, 0)
            return vllm_samples(self.policy_dir, prompt_ids, max_new_tokens, eos)
        out: List[List[int]] = []
        for start in range(0, len(prompt_ids), batch_size):  # the fault drills count finished prompts
            self.faults.check(shard, start)
            out += greedy_generate_batch(self.policy, prompt_ids[start:start + batch_size], max_new_tokens, eos,
                                         batch_size)
        return out

    @endpoint
    def calibrate(self, shard: int, batches: List[Tensor]) -> observers.ObserverState:
        for mod in self.prepared.modules():  # each shard reports only its own data
            if isinstance(mod, torch.ao.quantization.MinMaxObserver):
                mod.reset_min_max_vals()
        for i, batch in enumerate(batches):
            self.faults.check(shard, i)
            recipes.calibrate(self.prepared, [batch])
        return observers.observer_state(self.prepared)

    @endpoint
    def channel_stats(self, shard: int, batches: List[Tensor]) -> Dict[str, Tensor]:
        """Per input channel max |x| of the smoothing groups' linears over this shard."""
        from policy_bundle.quantize.calibration.smooth import collect_channel_absmax

        self.faults.check(shard, 0)
        return collect_channel_absmax(self.policy, batches)

    @endpoint
    def smooth(self, scales: Dict[str, Tensor]) -> bool:
        """Re-prepare from the smoothed policy (the same scales the controller applies)."""
        self.smoothing, self._prepared = scales, None
        return True

    @endpoint
    def token_absmax(self, shard: int, batches: List[Tensor]) -> Dict[str, Tensor]:
        """w8a8 pass 1: every row's max |x| per input group, over this shard."""
        from policy_bundle.quantize.calibration.linear_stats import collect_token_absmax

        self.faults.check(shard, 0)
        return collect_token_absmax(self.policy, batches)

    @endpoint
    def group_stats(self, shard: int, batches: List[Tensor], thresholds: Dict[str, float], hessians: bool):
        """w8a8 pass 2 for the groups in ``thresholds`` (a few layers per call: Hessians are large)."""
        from policy_bundle.quantize.calibration.linear_stats import collect_group_stats

        self.faults.check(shard, 0)
        return collect_group_stats(self.policy, batches, thresholds, hessians=hessians, seed=shard)


def _return_freed_memory() -> None:
    """Collect, then hand the C heap's free pages back to the system: glibc keeps them otherwise, and an actor that ran
    rollouts over the whole model stayed that much larger through the layer plan (a 0.6B policy: 1.2 GB anonymous
    per actor while it held one share's Hessians)."""
    import gc

    from policy_bundle.quantize.runtime.script_runner import release_freed_memory

    gc.collect()
    release_freed_memory()
