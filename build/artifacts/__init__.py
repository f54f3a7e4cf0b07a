"""Stages 6-9, export, fidelity, manifest, register: the bundle written, measured, checksummed, registered."""
