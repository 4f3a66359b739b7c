"""The front door: the `npu-pool` dispatcher, extras, the launcher (up, demo, embedded Redis);
see docs/architecture.md §1."""
