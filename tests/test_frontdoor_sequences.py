"""Triton's sequences through the front door as Triton defines them, with tritonclient over gRPC and HTTP against a
real server: Triton's sequence client examples (on one ModelStreamInfer stream, each request sent without waiting
for the one before or one at a time; unary, one at a time) answer as the reference run over the sequence's tokens
so far; a start always starts from zeros, also for two starts of one id in flight together; a continuation behind
a failed start continues nothing.

Unary calls sent side by side (gRPC calls, tritonclient's async_infer) reach the server in no defined order, as in
Triton, whose streams are what keep a sequence's order; so they are sent one at a time here, and a unary request
that arrives while its sequence's previous one runs is tested in tests/test_frontdoor_sequence_limits.py."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from oip_server import Door, close
from tritonclient.utils import InferenceServerException

# (request id, sequence id, tokens, sequence_start, sequence_end), in the order sent.
Step = tuple[str, Any, list[int], bool, bool]


def interleaved(sequences: dict[Any, list[list[int]]]) -> list[Step]:
    """The sequences' chunks sent in turn, one chunk of each, as Triton's sequence examples send two sequences."""
    steps = []
    for index in range(max(len(chunks) for chunks in sequences.values())):
        for sequence_id, chunks in sequences.items():
            if index < len(chunks):
                last = index == len(chunks) - 1
                steps.append((f"{sequence_id}-{index}", sequence_id, chunks[index], index == 0, last))
    return steps


def expected(door: Door, steps: list[Step]) -> dict[str, np.ndarray]:
    """Each request's h_n: the reference run over its sequence's tokens up to and including its own."""
    tokens: dict[Any, list[int]] = {}
    answers = {}
    for request_id, sequence_id, chunk, start, _ in steps:
        tokens[sequence_id] = (chunk if start else tokens[sequence_id] + chunk)
        answers[request_id] = np.asarray(door.reference("lstm", {"tokens": tokens[sequence_id]})["h_n"])
    return answers


def grpc_tokens(chunk: list[int]) -> list[grpcclient.InferInput]:
    item = grpcclient.InferInput("tokens", [len(chunk)], "INT64")
    item.set_data_from_numpy(np.array(chunk, dtype=np.int64))
    return [item]


def http_tokens(chunk: list[int]) -> list[httpclient.InferInput]:
    item = httpclient.InferInput("tokens", [len(chunk)], "INT64")
    item.set_data_from_numpy(np.array(chunk, dtype=np.int64))
    return [item]


def fields(step: Step) -> dict[str, Any]:
    request_id, sequence_id, _, start, end = step
    return {"request_id": request_id, "sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}


# Each way returns the answer to each request by id: its h_n, or the error it got.
Answers = dict[str, Any]


def grpc_stream(door: Door, steps: list[Step], pipelined: bool) -> Answers:
    """Triton's simple_grpc_sequence_stream_infer_client: every request on one ModelStreamInfer stream."""
    replies: queue.Queue = queue.Queue()
    triton = grpcclient.InferenceServerClient(door.grpc)
    triton.start_stream(callback=lambda result, error: replies.put(error or result))
    answers: Answers = {}
    errors = []

    def collect() -> None:
        reply = replies.get(timeout=60)
        if isinstance(reply, InferenceServerException):  # a stream's error names no request: kept in order
            errors.append(reply)
        else:
            answers[reply.get_response().id] = reply.as_numpy("h_n")

    try:
        for step in steps:
            triton.async_stream_infer("lstm", grpc_tokens(step[2]), **fields(step))
            if not pipelined:
                collect()
        while len(answers) + len(errors) < len(steps):
            collect()
    finally:
        triton.stop_stream()
    return answers | {f"error-{index}": error for index, error in enumerate(errors)}


def grpc_unary(door: Door, steps: list[Step], pipelined: bool) -> Answers:
    """Triton's simple_grpc_sequence_sync_infer_client (`pipelined`: calls in flight together, in no order)."""
    triton = grpcclient.InferenceServerClient(door.grpc)
    replies: queue.Queue = queue.Queue()
    for step in steps:
        callback = lambda result, error, request_id=step[0]: replies.put((request_id, error or result))
        triton.async_infer("lstm", grpc_tokens(step[2]), callback, **fields(step))
        if not pipelined:
            replies.put(replies.get(timeout=60))
    answers = dict(replies.get(timeout=60) for _ in steps)
    return {key: value if isinstance(value, Exception) else value.as_numpy("h_n") for key, value in answers.items()}


def http_unary(door: Door, steps: list[Step]) -> Answers:
    """Triton's simple_http_sequence_sync_infer_client."""
    triton = httpclient.InferenceServerClient(door.http)
    return {step[0]: triton.infer("lstm", http_tokens(step[2]), **fields(step)).as_numpy("h_n") for step in steps}


WAYS: dict[str, Callable[[Door, list[Step]], Answers]] = {
    "grpc-stream-without-waiting": lambda door, steps: grpc_stream(door, steps, pipelined=True),
    "grpc-stream-one-at-a-time": lambda door, steps: grpc_stream(door, steps, pipelined=False),
    "grpc-unary": lambda door, steps: grpc_unary(door, steps, pipelined=False),
    "http": http_unary,
}


@pytest.mark.parametrize("way", list(WAYS))
def test_two_interleaved_sequences_answer_as_the_reference_over_their_tokens_so_far(door: Door, way: str):
    offset = 100 * list(WAYS).index(way)
    steps = interleaved(
        {
            7300 + offset: [[3, 4], [5, 6, 7], [8], [9, 10]],
            f"sentence-{offset}": [[11], [12, 13], [14, 15, 16]],
        }
    )
    answers = WAYS[way](door, steps)
    references = expected(door, steps)
    assert set(answers) == set(references), answers
    for request_id, h_n in answers.items():
        assert close(h_n, references[request_id]), request_id


def test_two_starts_of_one_id_in_flight_together_each_start_from_zeros(door: Door):
    """Both starts reach the server before either is answered: the later replaces the earlier's session."""
    steps: list[Step] = [("first", "twin", [21, 22, 23], True, False), ("second", "twin", [21, 22, 23], True, False)]
    answers = grpc_unary(door, steps, pipelined=True)
    alone = door.reference("lstm", {"tokens": [21, 22, 23]})["h_n"]
    assert close(answers["first"], alone) and close(answers["second"], alone)
    last = grpc_unary(door, [("end", "twin", [24], False, True)], pipelined=False)["end"]
    assert close(last, door.reference("lstm", {"tokens": [21, 22, 23, 24]})["h_n"])


def test_what_follows_a_failed_start_on_a_stream_continues_nothing(door: Door):
    outside_the_vocabulary = [5000]
    steps: list[Step] = [
        ("bad-start", "doomed", outside_the_vocabulary, True, False),
        ("then", "doomed", [1, 2], False, False),
        ("end", "doomed", [3], False, True),
    ]
    answers = grpc_stream(door, steps, pipelined=True)
    errors = [answers[f"error-{index}"].message() for index in range(3)]
    assert "INVALID_INPUT" in errors[0] and all("SESSION_LOST" in error for error in errors[1:]), errors
    again = grpc_stream(door, [("again", "doomed", [1, 2], True, True)], pipelined=True)["again"]
    assert close(again, door.reference("lstm", {"tokens": [1, 2]})["h_n"])
