"""Served answers against the unbatched reference: every policy must return what the model computes."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from batchmaker.clients import AsyncClient
from batchmaker.common.models.base import Model
from batchmaker.common.models.seq2seq import decoding_mismatch

TOLERANCE = 1e-4  # float32, hidden 256: batched and unbatched sums differ in the last bits
NEAR_TIE = 1e-4  # a decoded token may differ only where the reference's top-two logits are this close


def mismatch(model: Model, state: dict, inputs: dict[str, Any], outputs: dict[str, Any]) -> tuple[float, str | None]:
    """(max abs error over float outputs, description of a wrong decoded sequence or None)."""
    return differences(model.reference(state, inputs), outputs)


def differences(expected: dict[str, Any], outputs: dict[str, Any]) -> tuple[float, str | None]:
    """`mismatch` against the reference's reply `expected`, already computed."""
    worst = 0.0
    for name, value in outputs.items():
        want = expected[name]
        if np.asarray(want).dtype.kind in "iu":  # decoded tokens: equal, but for argmax near-ties
            if "margins" in expected:
                problem = decoding_mismatch(np.asarray(value), expected, NEAR_TIE)
            else:
                problem = None if np.array_equal(value, want) else f"{name} is {value}, expected {want}"
            if problem:
                return worst, problem
        else:
            worst = max(worst, float(np.abs(np.asarray(value) - want).max()))
    return worst, None


async def _ask(address: str, model: str, requests: list[dict[str, Any]]) -> list[Any]:
    async with AsyncClient(address, timeout=120) as client:
        return await asyncio.gather(*(client.infer(model, inputs) for inputs in requests))


def verify(address: str, model: Model, state: dict, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Send the requests at once (so they batch together) and compare every reply with the reference."""
    replies = asyncio.run(_ask(address, model.name, requests))
    return compare(model, state, requests, [reply.outputs for reply in replies])


def compare(model: Model, state: dict, requests: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """Served outputs against the reference's, request by request: the largest error and what was wrong."""
    return compare_replies([model.reference(state, inputs) for inputs in requests], outputs)


def compare_replies(expected: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """`compare` against the reference's replies, already computed."""
    worst, problems = 0.0, []
    for want, served in zip(expected, outputs, strict=True):
        error, problem = differences(want, served)
        worst = max(worst, error)
        if problem:
            problems.append(problem)
    return {
        "checked": len(outputs),
        "max_abs_error": worst,
        "wrong": problems[:3],
        "ok": worst <= TOLERANCE and not problems,
    }
