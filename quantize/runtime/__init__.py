"""Running a policy: the one decode loop, sequences on block-grown KV caches (slots), the int8 kernels, the INT8
TorchScript runner, vLLM in one place, token ids to text, and the memory this process may use."""
