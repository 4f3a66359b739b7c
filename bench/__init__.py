"""Benchmarks: the serving bench, its report, the load generator, ceilings and peers."""
