"""Flotilla's inference engine: paged KV cache, prefix cache, one-rule scheduler, model runner."""
