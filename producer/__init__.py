"""Producer side of npu-pool: the client library, CLI commands and the pool launcher."""

from producer.client import AsyncClient, Client, QueueFull

__all__ = ["AsyncClient", "Client", "QueueFull"]
