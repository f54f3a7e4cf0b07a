"""The policy model in plain torch: its layers, its shape read from an HF config, and HF safetensors in and out
(memory-mapped, one tensor at a time)."""
