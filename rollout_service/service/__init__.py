"""The Ray service: RolloutWorker actors under a supervisor, the pool actor, its client, and how
weights travel to the workers (weight_sync)."""
