"""Thin clients for the batchmaker wire protocol; they need only pyzmq, msgpack and numpy."""

from .async_client import AsyncClient
from .errors import RequestTooLarge, ServerError, ServerLost
from .messages import Reply
from .retry import Backoff
from .streams import Partial
from .sync_client import Client

__all__ = ["AsyncClient", "Backoff", "Client", "Partial", "Reply", "RequestTooLarge", "ServerError", "ServerLost"]
