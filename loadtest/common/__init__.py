"""Helpers shared by the benchmarks in loadtest/."""
