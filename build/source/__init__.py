"""Stage 1, load policy: the FP32 policy from an HF directory, the reference policy or a torchtitan checkpoint."""
