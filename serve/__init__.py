"""Serving, by the process each part runs in: ``router/`` (the service clients call), ``variants/`` (the INT8 and FP16
workers behind it), ``rollout/`` (the staged canary's control plane); the modules both processes share sit here."""
