"""What a producer service uses: Client and AsyncClient, result streams, the submit, cancel and
status commands, the HTTP gateway (an HTTP producer) and RQ batch jobs (an offline producer)."""

from producer.client import AsyncClient, Client, NotReplicated, QueueFull, UnknownTenant

__all__ = ["AsyncClient", "Client", "NotReplicated", "QueueFull", "UnknownTenant"]
