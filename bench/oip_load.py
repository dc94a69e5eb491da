"""Open-loop load through the Open Inference Protocol's gRPC API with Triton's own client
(`tritonclient.grpc.aio`), in a process of its own: the same generator drives batchmaker's gRPC front door
and Triton, so that the two are compared under one client.

Request i is sent at `due[i]` seconds whatever the replies; its tensors are built before the run, so the run
costs the client only the calls. The result is the ZeroMQ load generator's `OpenLoop` (bench/client_load.py).
To a target taking sequences (Triton's sequence batcher), a request is a sequence of calls of a few tokens
each, each sent when the one before it is answered, and is answered by its last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchmaker.bench.client_load import OpenLoop, in_event_loop, on_schedule
from batchmaker.bench.generator import spawned

TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Target:
    """A model behind a gRPC endpoint ("host:port"), the outputs asked of it, whether it takes a batch
    dimension (Triton with max_batch_size > 0: tokens shaped [1, n], outputs [1, ...]), and, where it takes a
    request as a sequence of calls (Triton's sequence batcher), how many tokens each call carries."""

    url: str
    model: str
    outputs: tuple[str, ...]
    batched: bool
    tokens_per_call: int | None = None  # None: a request is one call

    def calls(self, tokens: list[int]) -> list[tuple[int, ...]]:
        """The tokens of each call a request of `tokens` is sent as."""
        if self.tokens_per_call is None:
            return [tuple(tokens)]
        return [tuple(tokens[i : i + self.tokens_per_call]) for i in range(0, len(tokens), self.tokens_per_call)]

    def tensor(self, tokens: list[int]) -> Any:
        """The request's `tokens` as the model's INT64 input."""
        import tritonclient.grpc as grpcclient

        array = np.asarray(tokens, dtype=np.int64)
        array = array[None] if self.batched else array
        tensor = grpcclient.InferInput("tokens", list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        return tensor

    def unbatched(self, result: Any) -> dict[str, np.ndarray]:
        return {name: result.as_numpy(name)[0] if self.batched else result.as_numpy(name) for name in self.outputs}


async def _open_loop(target: Target, requests: list[list[int]], due: np.ndarray, keep_outputs: bool) -> OpenLoop:
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio
    from tritonclient.utils import InferenceServerException

    count = len(due)
    run = OpenLoop(due, np.full(count, np.nan), np.full(count, np.nan), [None] * count, [None] * count)
    wanted = [grpcclient.InferRequestedOutput(name) for name in target.outputs]
    calls = [target.calls(request) for request in requests[:count]]
    # One tensor per distinct call, shared by every request sending it (the load repeats the dataset's sentences).
    by_tokens = {tokens: target.tensor(list(tokens)) for tokens in {c for request in calls for c in request}}
    tensors = [[by_tokens[c] for c in request] for request in calls]
    first_sequence = int(np.random.default_rng().integers(1, 2**62))  # ids apart from any earlier run's
    async with grpcaio.InferenceServerClient(target.url) as client:
        start = time.monotonic()

        async def infer(index: int) -> Any:
            if target.tokens_per_call is None:
                return await client.infer(target.model, tensors[index], outputs=wanted, client_timeout=TIMEOUT_S)
            last, result = len(tensors[index]) - 1, None
            for step, tensor in enumerate(tensors[index]):
                result = await client.infer(
                    target.model,
                    [tensor],
                    outputs=wanted,
                    client_timeout=TIMEOUT_S,
                    sequence_id=first_sequence + index,
                    sequence_start=step == 0,
                    sequence_end=step == last,
                )
            if result is None:
                raise InferenceServerException("a sequence needs at least one token", status="EMPTY_SEQUENCE")
            return result

        async def one(index: int) -> None:
            run.sent[index] = time.monotonic() - start
            try:
                result = await infer(index)
                if keep_outputs:
                    run.outputs[index] = target.unbatched(result)
            except InferenceServerException as exc:
                run.errors[index] = exc.status() or "ERROR"
            run.received[index] = time.monotonic() - start

        run.cpu_seconds = await on_schedule(due, start, one)
    return run


def open_loop(target: Target, requests: list[list[int]], due: np.ndarray, keep_outputs: bool = False) -> OpenLoop:
    """Send `requests[i]` (token ids) to `target` at `due[i]` seconds; wait for every answer (and keep its
    outputs, with `keep_outputs`)."""
    return spawned(in_event_loop, _open_loop, target, requests, due, keep_outputs)
