"""What leaves the library: the INT8 TorchScript and ONNX files, the FP16 HF directory, and the compressed-tensors
W8A8 checkpoint vLLM serves (with the rotations it applies online)."""
