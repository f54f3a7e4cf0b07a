"""The bundle format, the floor build/ and serve/ share: the manifest and its verification, the model-store
entry layout, the tokenizer, the golden set, prompt encoding and ``BundleInfo`` (what serving needs to know
about a bundle: context length, task flag, gate thresholds). Imports only ``policy_bundle.quantize``."""
