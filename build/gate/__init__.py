"""Stage 5, convert + accuracy gate: each recipe candidate gated on the golden set with layer fallback."""
