"""Layer sensitivity, one implementation for every recipe family: how far the final logits move when one
linear alone is quantized.

The reference is the float model the recipe quantizes (smoothed or rotated where the recipe does that, no
linear quantized); each linear's quantized module is swapped into it for one forward on a small probe of
calibration tokens, and the score is KL(reference || swapped) of the next-token distributions, averaged over
the probe's positions. A local output error misses how an error grows through the layers above (on
SmolLM2-135M it ranked the one linear that mattered most 17th); one forward per linear on the probe costs
little (a golden-set pass per linear took 29 minutes per candidate there).

The torch.ao recipes swap in the linear's converted module (``recipes.convert``), the w8a8 ones the plan's
``quantized_module``.

Nothing below a swapped linear changes, so the probe's float input of every decoder layer is computed once and a
linear of layer i runs only layers i.. and the head (``layer_stream.run_layer``, bitwise what the whole forward
computes): on average half a forward per linear, in the process that already holds the float model, so no other
process maps the model for the ranking.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from policy_bundle.quantize.calibration.layer_stream import run_layer
from policy_bundle.quantize.model.policy import full_logits

Quantized = Callable[[str, nn.Module], nn.Module]  # (linear's name, its float module) -> its quantized module


def sensitivity_probe(batches: Sequence[Tensor], rows: int = 2, tokens: int = 64) -> Tensor:
    """A few calibration sequences (the longest batch's first rows, at most ``tokens`` long)."""
    longest = max(batches, key=lambda b: b.shape[1])
    return longest[:rows, :tokens]


class SwapSensitivity:
    """Scores one linear at a time against the reference logits of ``model`` (the float model) on ``probe``.

    A decoder-layer model (``layers``, ``norm``, ``lm_head``) keeps the probe's float input of each layer
    (``inputs[i]``, and ``inputs[-1]`` the last layer's output: [rows, tokens, dim] each), and a linear of layer i
    is scored from ``inputs[i]``; another model runs whole for each score."""

    @torch.no_grad()
    def __init__(self, model: nn.Module, probe: Tensor):
        self.model, self.probe = model, probe
        self.inputs: Optional[List[Tensor]] = None
        if all(hasattr(model, a) for a in ("layers", "norm", "lm_head", "embed_tokens", "_chunk_tables")):
            x = model.embed_tokens(probe)
            self.inputs = [x]
            for i in range(len(model.layers)):
                x = run_layer(model, i, [x])[0]
                self.inputs.append(x)
            logits = model.lm_head(model.norm(x))
        else:
            logits = full_logits(model, probe)
        self.ref = F.log_softmax(logits.double(), dim=-1)

    def _start(self, name: str) -> Optional[int]:
        """The first layer a swap of ``name`` changes (``len(layers)``: only the head), or None (run it whole)."""
        if self.inputs is None:
            return None
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
            return int(parts[1])
        return len(self.inputs) - 1 if parts[0] in ("lm_head", "norm") else None

    @torch.no_grad()
    def _logits(self, start: Optional[int]) -> Tensor:
        if start is None:
            return full_logits(self.model, self.probe)
        x = self.inputs[start]
        for i in range(start, len(self.inputs) - 1):
            x = run_layer(self.model, i, [x])[0]
        return self.model.lm_head(self.model.norm(x))

    @torch.no_grad()
    def score(self, name: str, quantized: Quantized) -> float:
        """KL mean with only ``name`` quantized; the float module is back in place afterwards."""
        parent, _, child = name.rpartition(".")
        holder = self.model.get_submodule(parent) if parent else self.model
        float_module = getattr(holder, child)
        setattr(holder, child, quantized(name, float_module))
        try:
            lp = F.log_softmax(self._logits(self._start(name)).double(), dim=-1)
        finally:
            setattr(holder, child, float_module)
        return float((self.ref.exp() * (self.ref - lp)).sum(-1).mean())


def rank_by_sensitivity(scores: Sequence[Tuple[str, float]]) -> List[Tuple[str, float]]:
    """Most sensitive first; ties keep model order (the same ranking however the scores were sharded)."""
    return sorted(scores, key=lambda t: -t[1])


def layer_sensitivity(model: nn.Module, names: Sequence[str], quantized: Quantized, probe: Tensor,
                      progress: Callable[[int, int, str, float], None] = lambda *_: None) -> List[Tuple[str, float]]:
    """Every named linear's ``SwapSensitivity`` score in this process, most sensitive first; ``progress`` gets
    (done, total, the most sensitive name so far, its KL) after each."""
    scorer = SwapSensitivity(model, probe)
    scores: List[Tuple[str, float]] = []
    for i, name in enumerate(names):
        scores.append((name, scorer.score(name, quantized)))
        worst = max(scores, key=lambda t: t[1])
        progress(i + 1, len(names), worst[0], worst[1])
    return rank_by_sensitivity(scores)
