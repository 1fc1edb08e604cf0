"""Decode across GPUs: each rank attends its shard of the context; the partial states merge exactly."""
