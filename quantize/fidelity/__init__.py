"""How close a candidate policy is to its reference: the metrics the build gate and the live canary share,
teacher-forced comparison in bounded memory, and per-linear sensitivity."""
