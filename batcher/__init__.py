"""The batcher: plans steps for a pool of ranks and moves requests through it."""
