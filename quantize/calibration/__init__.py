"""What calibration measures on a policy: per-linear input statistics, one decoder layer at a time, observer ranges
merged across shards, samples that would set a scale alone, and the smoothing those statistics drive."""
