"""The variant workers: the INT8 and FP16 BentoML services the router depends on, their engines (the TorchScript
engine with continuous batching over decode lanes, vLLM) and the batcher between them."""
