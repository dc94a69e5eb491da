"""The manager's table of requests routed whole to workers: placement, the expected wait, answers, ends, deadlines,
a lost worker's requests and streams' partials, on a clock the tests move."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchmaker.common.protocol import (
    DEADLINE_EXCEEDED,
    OVERLOADED,
    RequestError,
    decode,
    map_to_tensor,
    tensor_to_map,
)
from batchmaker.manager.batching.routed import MIN_ANSWERS, RATE_WINDOW_S, Routed, RoutedRequests


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Model:
    name = "lstm"


def request(i: int, deadline: float | None = None, client: bytes = b"c", priority: int = 0, stream: bool = False):
    return Routed(client, i, Model(), {"tokens": [i]}, 100.0, deadline, priority, stream)  # type: ignore[arg-type]


WINDOW = 16  # requests a worker's running batch holds at once


def table(max_queue_delay_ms: int = 100) -> tuple[RoutedRequests, Clock]:
    clock = Clock()
    return RoutedRequests(max_queue_delay_ms, WINDOW, clock), clock


def test_requests_go_to_the_worker_holding_fewest_with_one_frame_each():
    routed, _ = table()
    requests = [request(i, priority=i - 2, stream=i == 1) for i in range(5)]
    for each in requests:
        routed.route(each, [3, 7])
    assert [each.worker_id for each in requests] == [3, 7, 3, 7, 3]
    sends, drops = routed.take_sends()
    assert {worker: [decode(frame) for frame in frames] for worker, frames in sends.items()} == {
        3: [[1, "lstm", {"tokens": [0]}, -2, False], [3, "lstm", {"tokens": [2]}, 0, False],
            [5, "lstm", {"tokens": [4]}, 2, False]],
        7: [[2, "lstm", {"tokens": [1]}, -1, True], [4, "lstm", {"tokens": [3]}, 1, False]],
    }  # fmt: skip
    assert drops == {} and routed.take_sends() == ({}, {})
    assert routed.snapshot()["by_worker"] == {"3": 3, "7": 2}
    assert (b"c", 4) in routed and routed.get(b"c", 4) is requests[4] and len(routed) == 5


def test_an_answer_from_another_worker_or_for_an_ended_request_is_ignored():
    routed, _ = table()
    first, second = request(1), request(2)
    routed.route(first, [0, 1])
    routed.route(second, [0, 1])
    assert routed.answered(1, first.handle) is None  # first runs on worker 0
    assert routed.answered(0, "not a handle") is None
    assert routed.answered(0, first.handle) is first
    assert routed.answered(0, first.handle) is None  # answered once
    routed.end([second])
    assert routed.take_sends()[1] == {1: [second.handle]}
    assert routed.answered(1, second.handle) is None
    assert len(routed) == 0 and (b"c", 2) not in routed


def test_the_expected_wait_is_the_requests_in_flight_over_the_answer_rate():
    routed, clock = table(max_queue_delay_ms=500)
    assert routed.expected_wait_s() is None and routed.answer_rate() is None
    assert routed.overload(1, None) is None  # nothing measured: nothing refused
    routed.check_deadline(5, None)
    answered = [request(i) for i in range(MIN_ANSWERS)]
    for each in answered:
        routed.route(each, [0])
        routed.answered(0, each.handle)
    for i in range(10):
        routed.route(request(100 + i), [0])
    rate = routed.answer_rate()
    assert rate == MIN_ANSWERS / RATE_WINDOW_S
    assert routed.expected_wait_s() == pytest.approx(10 / rate)
    assert routed.overload(1, rate) is None
    for i in range(10):
        routed.route(request(200 + i), [0])
    refused = routed.overload(1, rate)
    assert refused is not None and refused.code == OVERLOADED
    assert "exceeds the server's limit of 500 ms (20 requests in flight)" in refused.message
    routed.check_deadline(None, rate)
    routed.check_deadline(1000, rate)
    with pytest.raises(RequestError) as late:
        routed.check_deadline(5, rate)
    assert late.value.code == DEADLINE_EXCEEDED and "deadline_ms 5" in late.value.message
    wait = routed.expected_wait_s()
    spacing_ms = RATE_WINDOW_S / MIN_ANSWERS * 1e3
    first = (wait - 0.5) * 1e3
    assert routed.retry_after_ms(3) == [math.ceil(first + i * spacing_ms) for i in range(3)]
    clock.now += 2 * RATE_WINDOW_S  # the answers leave the window: no estimate
    assert routed.retry_after_ms(3) == []
    assert routed.expected_wait_s() is None and routed.answer_rate() is None


def test_before_the_rate_is_measured_the_workers_running_batches_bound_the_requests_in_flight():
    routed, _ = table(max_queue_delay_ms=500)
    for i in range(2 * WINDOW - 1):
        routed.route(request(i), [0, 1])
    assert routed.overload(2, None) is None  # one more fits in two workers' windows
    routed.route(request(99), [0, 1])
    refused = routed.overload(2, None)
    assert refused is not None and refused.code == OVERLOADED and "rate is not measured yet" in refused.message
    assert routed.overload(3, None) is None  # a third worker holds more
    unbounded, _ = table(max_queue_delay_ms=0)  # no refusal by the wait: none by the window either
    for i in range(2 * WINDOW):
        unbounded.route(request(i), [0])
    assert unbounded.overload(1, None) is None and unbounded.overload(1, 1.0) is None


def test_deadlines_expire_in_order_and_bound_the_loops_sleep():
    routed, clock = table()
    early, late, none = request(1, deadline=100.5), request(2, deadline=101.0), request(3)
    for each in (late, early, none):
        routed.route(each, [0])
    assert routed.wait_ms(1000) == 501
    clock.now = 100.6
    assert routed.expired() == [early]
    routed.end([early])
    assert routed.wait_ms(1000) == 401
    routed.end([late])
    assert routed.wait_ms(1000) == 1000  # the ended request's deadline no longer counts
    clock.now = 102.0
    assert routed.expired() == []


def test_a_lost_workers_requests_are_routed_again_or_forgotten():
    routed, _ = table()
    requests = [request(i) for i in range(4)]
    for each in requests:
        routed.route(each, [0, 1])
    routed.take_sends()
    lost = routed.lost(0)
    assert lost == [requests[0], requests[2]] and len(routed) == 2
    routed.route(lost[0], [1])
    routed.forget_lost(lost[1])
    sends, _ = routed.take_sends()
    assert [decode(frame)[0] for frame in sends[1]] == [requests[0].handle]  # the same handle, on worker 1
    assert (b"c", 0) in routed and (b"c", 2) not in routed
    assert routed.answered(1, requests[0].handle) is requests[0]


def test_requests_of_departed_clients_are_found():
    routed, _ = table()
    mine, theirs = request(1, client=b"a"), request(1, client=b"b")
    routed.route(mine, [0])
    routed.route(theirs, [0])
    assert routed.of_clients({b"b"}) == [theirs]
    assert routed.all() == [mine, theirs]


def test_a_worker_holding_requests_without_steps_is_stalled():
    routed, clock = table()
    routed.route(request(1), [0, 1])
    routed.route(request(2), [0, 1])
    clock.now += 5
    routed.progressed(1)
    clock.now += 6
    assert routed.stalled(10) == {0: 11}  # worker 1 reported 6 s ago
    routed.answered(0, 1)
    assert routed.stalled(10) == {}  # it holds nothing now
    routed.route(request(3), [0])
    clock.now += 11
    assert routed.stalled(10) == {0: 11, 1: 17}  # counted from when work arrived at the idle one


def tokens(*values: int) -> dict:
    return {"tokens": tensor_to_map(np.array(values, np.int64))}


def sent_tokens(partial: tuple[dict, bool]) -> tuple[list[int], bool]:
    outputs, restarted = partial
    return (map_to_tensor(outputs["tokens"]).tolist() if outputs else []), restarted


def test_a_streams_partials_wait_for_its_client_and_go_out_joined_once_a_turn():
    routed, _ = table()
    streamed, plain = request(1, stream=True), request(2, client=b"d")
    routed.route(streamed, [0])
    routed.route(plain, [0])
    routed.partial(0, streamed.handle, tokens(4))
    routed.partial(0, streamed.handle, tokens(5, 6))
    routed.partial(0, plain.handle, tokens(9))  # not a stream: nothing to send
    routed.partial(1, streamed.handle, tokens(7))  # not its worker: a message of a worker it left
    routed.partial(0, streamed.handle, {"tokens": [1]})  # not a tensor map: dropped
    assert routed.partials(lambda client: client == b"c") == []  # its client has replies waiting: it keeps them
    [(request_, outputs, restarted)] = routed.partials(lambda client: False)
    assert request_ is streamed and sent_tokens((outputs, restarted)) == ([4, 5, 6], False)
    assert routed.partials(lambda client: False) == [] and routed.last_partial(streamed) is None


def test_a_stream_that_lost_its_worker_says_restarted_in_its_next_partial():
    routed, _ = table()
    streamed, quiet = request(1, stream=True), request(2, stream=True)
    routed.route(streamed, [0])
    routed.route(quiet, [0])
    routed.partial(0, streamed.handle, tokens(4))
    lost = routed.lost(0)
    assert routed.partials(lambda client: False) == []  # what the lost worker sent is void
    for each in lost:
        routed.route(each, [1])
    routed.partial(0, streamed.handle, tokens(8))  # late, from the lost worker
    routed.partial(1, streamed.handle, tokens(5))
    [(request_, outputs, restarted)] = routed.partials(lambda client: False)
    assert request_ is streamed and sent_tokens((outputs, restarted)) == ([5], True)
    assert sent_tokens(routed.last_partial(quiet)) == ([], True)  # answered before a new partial: an empty one
