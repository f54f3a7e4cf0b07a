"""The W8A8 scheme (per-token int8 activations, per-channel int8 weights): its linear and vocabulary ends, the plan
from calibration statistics to an INT8 policy (smoothing search, rotation, GPTQ), and the same plan a layer at a
time. Read ``plan.py`` from the top: it calls the rest."""
