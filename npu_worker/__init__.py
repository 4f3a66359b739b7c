"""A worker rank: model, KV cache, fixed-shape launches, sampler, detokenizer, publisher."""
