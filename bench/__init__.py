"""Benchmarks: the serving bench, its report, the load generator, ceilings and peers
(docs/architecture.md §10; figures in bench/RESULTS.md)."""
