"""Stages 2-4, rollouts, prepare, calibrate: prompts, rollouts, the golden split, calibration on the Monarch mesh."""
