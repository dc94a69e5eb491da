"""Thin clients for the batchmaker wire protocol; they need only pyzmq, msgpack and numpy."""

from .async_client import AsyncClient
from .errors import ServerError, ServerLost
from .sync_client import Client, Partial, Reply

__all__ = ["AsyncClient", "Client", "Partial", "Reply", "ServerError", "ServerLost"]
