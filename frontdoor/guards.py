"""Who may make which call on a front door port (docs/protocol.md, "Open Inference Protocol", "Credentials").

The health probes (and /metrics) are open to anyone, so that load balancers and the kubelet need no secret.
Model control, the repository's load and unload, changes what every caller gets: it takes a token of its own,
`control_token_file`, and without one it is open on a loopback listener only. Every other call takes the
port's `token_file` token, when it has one. Both transports ask the same `Credentials`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from batchmaker.common.addresses import is_loopback
from batchmaker.common.frontdoor_config import DoorSecurity, bearer_matches

from .errors import FORBIDDEN, UNAUTHENTICATED, DoorError


class Call(enum.Enum):
    HEALTH = "health"  # liveness, readiness (the server's and a model's), metrics: open
    SERVICE = "service"  # inference, metadata, the repository index: the token, if any
    CONTROL = "control"  # loading and unloading models: the control token, or a loopback listener


@dataclass(frozen=True)
class Credentials:
    """A port's tokens, and how its calls carry them (`carrier`, formatted with the token's name)."""

    table: str  # "http" or "grpc": the config table the messages name
    address: str
    carrier: str  # "the header 'Authorization: Bearer {}'"; gRPC: its metadata
    token: str | None
    control_token: str | None

    @classmethod
    def of(cls, table: str, address: str, security: DoorSecurity, carrier: str) -> Credentials:
        return cls(table, address, carrier, security.token(), security.control_token())

    def check(self, call: Call, authorization: str) -> None:
        """Raise UNAUTHENTICATED for a missing or wrong token, FORBIDDEN for model control that is off."""
        if call is Call.HEALTH:
            return
        if call is Call.CONTROL:
            if self.control_token is not None:
                if not bearer_matches(authorization, self.control_token):
                    raise DoorError(
                        UNAUTHENTICATED,
                        f"loading and unloading models needs {self.carrier.format('<control token>')}, "
                        f"with the token of [{self.table}] control_token_file",
                    )
                return
            if not is_loopback(f"tcp://{self.address}"):
                raise DoorError(
                    FORBIDDEN,
                    f"loading and unloading models is off on {self.address}, which is not a loopback address: "
                    f"set [{self.table}] control_token_file to a file holding a token of its own, and send "
                    f"{self.carrier.format('<that token>')}",
                )
        if self.token is not None and not bearer_matches(authorization, self.token):
            raise DoorError(UNAUTHENTICATED, f"this server needs {self.carrier.format('<token>')}")
