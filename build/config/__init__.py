"""The build config, read before any stage: the schema of build/configs/*.yaml, its loader, auto candidates."""
