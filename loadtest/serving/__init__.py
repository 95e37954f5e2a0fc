"""Serving load tests against any OpenAI-compatible endpoint: workload generator, async streaming client,
statistics and the Markdown + PNG report."""
