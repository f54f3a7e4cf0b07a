"""``policy-bundle watch``: new training checkpoints checked for calibration drift; a rebuild when they drift."""
