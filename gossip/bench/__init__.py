"""Benchmark helpers: a multi-process runner and communication baselines."""
