"""A worker rank: the rank process (service, rank, plans), its compute (engine, runner,
backends, sampler, MTP, expert parallelism), its models (`models/`), each backend's kernels
(`kernels/`), the weight store (`weights/`) and its torch-free output process (`output/`)."""
