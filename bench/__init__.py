"""Benchmarks, load generation and the prefill:decode ratio tuner."""
