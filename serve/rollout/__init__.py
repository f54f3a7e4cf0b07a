"""The rollout control plane: the staged canary's state machine, its analysis windows and verdicts, and the state
store (SQLite, or PostgreSQL shared by replicas) it survives restarts and outages in."""
