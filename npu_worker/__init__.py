"""A worker rank: the rank process (plan reader, engine, runner, backends, sampler, MTP), its
models (`models/`) and its torch-free output process (`output/`)."""
