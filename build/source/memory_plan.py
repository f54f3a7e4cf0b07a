"""The build's memory plan, printed before any work: what the weights take, what one layer's calibration takes, the
expected peak over every process the build starts, and the machine's limit. A build that would not fit is refused
in one line before it starts (``BuildMemoryError``), naming the figure and the limit.

The figures are estimates from the policy's shape (read from config.json and the safetensors headers, nothing
loaded): the weights resident in the controller (memory-mapped: a 16-bit source's decoder layers stay 16-bit and one
layer at a time is widened to float32 for its call; the embedding and head are widened at load, in the controller and
in every calibration actor that loads the whole model), a decoder layer's Hessians (float64, one per input group) and GPTQ temporaries, the calibration set's hidden states
(a layer's input and output), the int8 policy the gate converts, the gate's teacher-forced batch (its float32 logits
and their double-precision log-softmax copies, ``TEACHER_FORCED_TOKENS`` positions: the reference's logits live in a
file, ``quantize/fidelity/reference_logits.py``), and a fixed share per process for Python, torch and Monarch.
``docs/benchmarks.md`` has the measured peaks beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from policy_bundle.build.errors import BuildError
from policy_bundle.quantize.runtime.memory import memory_limit
from policy_bundle.quantize.fidelity.reference_logits import TEACHER_FORCED_TOKENS

PROCESS_BASE = 450 * 2**20  # Python + torch + the project's imports, resident, measured per process
ACTOR_BASE = 350 * 2**20  # a Monarch calibration actor before it maps any weights


class BuildMemoryError(BuildError, MemoryError):
    """The build's expected peak memory exceeds what this machine (or its cgroup) allows."""


@dataclass(frozen=True)
class MemoryPlan:
    params: int
    source_bytes: int  # the safetensors data
    weights: int  # the weights resident in the controller (a 16-bit source's layers at 16 bits, the rest float32)
    layer_working_set: int  # one layer's Hessians + GPTQ temporaries + hidden states in and out
    int8_model: int  # the converted policy the gate runs (int8 weights, their packed copy, float embedding)
    gate_batch: int  # one teacher-forced batch's logits and the KL's copies of them
    actors: int  # every calibration actor's share: base + its share of the layers while it quantizes them
    peak: int  # expected, over every process the build starts
    limit: Optional[int]  # what the machine allows (None: unknown)
    limit_source: str

    def line(self) -> str:
        g = lambda b: f"{b / 2**30:.2f} GB"  # noqa: E731
        return (f"memory plan: {self.params / 1e6:.0f}M parameters, weights {g(self.source_bytes)} on disk, "
                f"{g(self.weights)} in the controller; one layer's working set {g(self.layer_working_set)}; "
                f"int8 policy {g(self.int8_model)}; gate batch {g(self.gate_batch)}; actors {g(self.actors)}; expected peak {g(self.peak)} over all "
                f"processes; limit {g(self.limit) if self.limit else 'unknown'} ({self.limit_source})")


def plan_memory(cfg, policy_dir: Path, tokens: int, procs: int) -> MemoryPlan:
    """The plan for building ``policy_dir`` with ``tokens`` calibration tokens (padded) and ``procs`` actors."""
    from policy_bundle.quantize.model.hf_weights import hf_weight_bytes, load_hf_config

    pc = load_hf_config(policy_dir, cfg.policy.max_seq_len)
    q, kv = pc.n_heads * pc.head_dim, pc.n_kv_heads * pc.head_dim
    per_layer = pc.dim * (q + 2 * kv) + q * pc.dim + 3 * pc.dim * pc.intermediate_size
    embed = pc.vocab_size * pc.dim
    params = pc.n_layers * per_layer + embed * (1 if pc.tie_embeddings else 2)
    source = sum(hf_weight_bytes(policy_dir).values())
    # a 16-bit source's layers stay 16-bit (``quantize.model.blocks.Block.narrow``), one widened at a time; its
    # embedding
    # and head are widened at load
    narrow = source < 0.75 * params * 4
    head = embed * 4 * (1 if pc.tie_embeddings else 2)
    weights = pc.n_layers * per_layer * (2 if narrow else 4) + head
    widened = per_layer * 4 if narrow else 0
    widest = max(pc.dim, q, pc.intermediate_size)
    hessians = 8 * (2 * pc.dim**2 + q**2 + pc.intermediate_size**2)
    gptq = 8 * 3 * max(pc.intermediate_size * pc.dim, min(embed, 4096 * pc.dim))  # weight, codes, a block's errors
    hidden = 2 * tokens * pc.dim * 4 + tokens * widest * 4 * 2  # a layer's input and output; its widest activation
    layer = hessians + gptq + hidden
    int8_model = 2 * pc.n_layers * per_layer + embed * 4 * (1 if pc.tie_embeddings else 2)
    # float32 logits of a batch, a double copy of both sides' log-softmax (vLLM's check: its own and the reference's)
    gate = TEACHER_FORCED_TOKENS * pc.vocab_size * (4 + 2 * 8)
    if procs:
        # Every actor maps the whole model for the rollouts: the mapped pages are the page cache's, shared with the
        # controller's map; a 16-bit source's embedding and head are widened in each actor, and a layer per call.
        whole = head + widened if narrow else 0
        share = -(-pc.n_layers // procs)
        actors = procs * (ACTOR_BASE + max(whole, 4 * share * per_layer + layer))
        controller = PROCESS_BASE + weights + widened + int8_model + max(hidden, gate)
    else:
        actors = 0
        controller = PROCESS_BASE + weights + widened + max(layer + params, int8_model + max(hidden, gate))
    limit, source_name = memory_limit()
    return MemoryPlan(params, source, weights, layer, int8_model, gate, actors, controller + actors, limit, source_name)


def check_memory(plan: MemoryPlan) -> None:
    """Refuse a build whose expected peak exceeds the limit, in one line."""
    if plan.limit is not None and plan.peak > plan.limit:
        raise BuildMemoryError(f"memory: this build would need about {plan.peak / 2**30:.1f} GB at its peak "
                               f"({plan.params / 1e6:.0f}M parameters: {plan.weights / 2**30:.1f} GB of weights in memory, "
                               f"{plan.layer_working_set / 2**30:.2f} GB per layer, {plan.actors / 2**30:.1f} GB in "
                               f"calibration actors), more than the {plan.limit / 2**30:.1f} GB this machine allows "
                               f"({plan.limit_source}); use a machine with more memory or calibration.procs: 0")
