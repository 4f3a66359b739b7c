"""One-off measurements behind figures in bench/RESULTS.md, each run as
`python -m bench.probes.NAME`: admission behind Sentinels, batch overhead, the CPU's split
between processes, dtype agreement, launch A/B, many streams, the soak, DeepSeek-V4's
launch breakdown and state size."""
