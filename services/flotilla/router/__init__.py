"""Router: worker registry, per-model admission queues, placement, and token-stream relay."""
