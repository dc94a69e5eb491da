"""Thin clients for the batchmaker wire protocol; they need only pyzmq, msgpack and numpy."""

from .async_client import AsyncClient
from .errors import ServerError, ServerLost
from .streams import Partial
from .sync_client import Client, Reply

__all__ = ["AsyncClient", "Client", "Partial", "Reply", "ServerError", "ServerLost"]
