"""Benchmarks and load generators: timing lives here, side by side in one run, never in unit tests."""
