"""Stage 5, convert + accuracy canary: each recipe candidate gated on the golden set with layer fallback."""
