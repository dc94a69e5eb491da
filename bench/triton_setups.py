"""The ways `bench http` sets Triton up to serve the bench LSTM, each recorded beside its numbers.

A capable Triton user serving this model on a CPU machine would reach for the sequence batcher's `direct`
strategy (each sequence holds a batch slot of one model instance from its first request to its last, so the
instance keeps its state), one model instance a core (each instance of Triton's Python backend is a process of
its own, so instances run in parallel), and several tokens a request (fewer round trips a sentence). Beside it
run the dynamic batcher (whole sentences; it joins only sentences of one length) and the sequence batcher's
`oldest` strategy with one model instance and one token a request, the setup measured before.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

MAX_BATCH = 64
# How long a batcher holds a request for others to join it. A sequence batcher's delay would be paid at every
# request of a sentence (2 ms made WMT sentences' p90 several times longer); its steps batch without one while a
# batch runs.
DYNAMIC_QUEUE_DELAY_US = 2000
TOKENS_PER_REQUEST = 8  # the direct setup's: a WMT sentence (about 25 tokens) in about 4 requests; 4 held 0.4x of 8
STRATEGIES = ("oldest", "direct")


def cores() -> int:
    """The cores this process may run on: one model instance each, by default."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Setup:
    """One Triton setup: its batcher (`dynamic`, or `sequence` with a strategy), its model instances, and how
    many tokens of a sentence each request carries (None: the whole sentence, as one request)."""

    name: str  # its key in the JSON and the report
    batcher: str
    strategy: str | None
    instances: int
    tokens_per_request: int | None
    max_batch: int = MAX_BATCH
    max_queue_delay_us: int = 0

    def __post_init__(self) -> None:
        if self.batcher == "dynamic":
            if self.strategy is not None or self.tokens_per_request is not None:
                raise ValueError(f"{self.name}: the dynamic batcher takes whole sentences, with no strategy")
        elif self.batcher != "sequence":
            raise ValueError(f"Triton has no {self.batcher} batcher here (only dynamic, sequence)")
        elif self.strategy not in STRATEGIES or not self.tokens_per_request or self.tokens_per_request < 1:
            raise ValueError(
                f"{self.name}: the sequence batcher needs a strategy ({', '.join(STRATEGIES)}) and at least one "
                f"token a request, not {self.strategy} and {self.tokens_per_request}"
            )
        if self.instances < 1:
            raise ValueError(f"{self.name}: Triton needs at least one model instance, not {self.instances}")

    def text(self) -> str:
        """The setup in words, as the results page prints it."""
        batcher = f"{self.batcher} batcher" + (f", {self.strategy} strategy" if self.strategy else "")
        delay = f"{self.max_queue_delay_us / 1000:g} ms queue delay" if self.max_queue_delay_us else "no queue delay"
        instances = f"{self.instances} model instance{'s' if self.instances > 1 else ''}"
        sent = (
            "one request a sentence"
            if self.tokens_per_request is None
            else f"{self.tokens_per_request} token{'s' if self.tokens_per_request > 1 else ''} a request"
        )
        return f"{batcher}, max batch {self.max_batch}, {delay}, {instances}, {sent}"

    def record(self) -> dict[str, Any]:
        """The setup as the JSON holds it: every field, and its words."""
        return asdict(self) | {"text": self.text()}


def setups(instances: int | None = None, tokens_per_request: int = TOKENS_PER_REQUEST) -> tuple[Setup, ...]:
    """The setups `bench http` measures: the dynamic batcher and the direct strategy with `instances` model
    instances (default: one a core), the direct strategy with `tokens_per_request`, and the oldest strategy as
    measured before (one instance, one token a request)."""
    count = cores() if instances is None else instances
    return (
        Setup("dynamic", "dynamic", None, count, None, max_queue_delay_us=DYNAMIC_QUEUE_DELAY_US),
        Setup("sequence oldest", "sequence", "oldest", 1, 1),
        Setup("sequence direct", "sequence", "direct", count, tokens_per_request),
    )
