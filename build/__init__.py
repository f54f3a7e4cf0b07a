"""The build step, ``policy-bundle build``: stage sub-packages (config, source, calibrate, gate, artifacts, watch)."""
