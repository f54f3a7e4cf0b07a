"""The INT8 TorchScript file is a deployable artifact on its own: a process with only torch (the project not imported)
that follows the recipe the manifest records (``artifacts.int8_torchscript_usage``) and docs/build.md show gets the
tokens the project's loader gets. The speed of that recipe against a plain call is printed by
``loadtest/bench_torchscript.py`` (a benchmark, not a timed assertion)."""

import json
import subprocess
import sys

from policy_bundle.quantize.runtime.decode import decode_steps, greedy_pick
from policy_bundle.quantize.runtime.script_runner import load_torchscript

PROMPT = [1, 6, 8, 13, 7, 14]
NEW = 12
# What a consumer with only torch runs: the manifest's recipe, nothing of ours (the -I flag and a neutral working
# directory keep the repository off sys.path; the script checks the project was never imported).
CONSUMER = r"""
import json, sys, torch
path, prompt, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
torch.backends.quantized.engine = "fbgemm"
m = torch.jit.load(path)
out = []
with torch.no_grad(), torch.jit.optimized_execution(False):
    k, v = m.new_cache(1, (len(prompt) + new + 31) // 32 * 32)
    logits = m.prefill(torch.tensor([prompt]), k, v)
    for pos in range(len(prompt), len(prompt) + new):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        logits = m.decode(torch.tensor([[nxt]]), pos, k, v)
assert not any(name.startswith("policy_bundle") for name in sys.modules), "the project was imported"
print(json.dumps(out))
"""


def test_a_consumer_with_only_torch_gets_the_served_tokens_from_the_file(small_bundle, tmp_path):
    manifest = json.loads((small_bundle / "bundle.json").read_text())
    usage = manifest["artifacts"]["int8_torchscript_usage"]
    assert "torch.jit.optimized_execution(False)" in usage and 'quantized.engine = "fbgemm"' in usage
    path = small_bundle / "int8" / "policy.ts"
    res = subprocess.run([sys.executable, "-I", "-c", CONSUMER, str(path), json.dumps(PROMPT), str(NEW)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = json.loads(res.stdout.strip().splitlines()[-1])
    ours = [s.token_id for s in decode_steps(load_torchscript(path), PROMPT, NEW, greedy_pick)]
    assert theirs == ours and len(ours) == NEW
