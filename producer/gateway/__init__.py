"""`npu-pool gateway`: an OpenAI-compatible HTTP front of the pool, with resumable SSE result
streams. It submits requests and reads result streams like any producer; it never imports
torch or the batcher."""
