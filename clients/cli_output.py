"""What the command-line client prints: replies for people (short) or for scripts (JSON, in full),
and a quiet end when the reader of its output goes away."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .messages import Reply
from .streams import Partial

PREVIEW_VALUES = 8
CLOSED_PIPE_STATUS = 128 + signal.SIGPIPE  # 141: what a shell reports for a command a closed pipe stopped


def closed_pipe_ends_quietly(command: Callable[[], int]) -> int:
    """Run a command that prints; when its reader goes away (`batchmaker stats | head`), end without a
    traceback, with stdout pointed at /dev/null so that the interpreter's last flush fails no more."""
    try:
        return command()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE_STATUS


def format_models(reply: dict[str, Any]) -> str:
    """A few lines a model: its kind and sizes, then its inputs, its outputs and its cell types."""
    lines = [f"protocol version {reply['version']}"] if "version" in reply else []
    for name, model in (reply.get("models") or {}).items():
        listed = (*DESCRIBED, "version", "versions")  # the newest version is the last of its versions' line
        facts = {key: value for key, value in model.items() if key not in listed}
        lines.append(f"{name}: {_facts(facts)}")
        for key, (heading, describe) in DESCRIBED.items():
            if model.get(key):
                lines.append(heading + ", ".join(f"{item} {describe(spec)}" for item, spec in model[key].items()))
        if model.get("versions"):
            lines.append("  versions: " + _versions(model["versions"]))
    for name, versions in (reply.get("unloaded") or {}).items():
        lines.append(f"{name}: not served; versions: {_versions(versions)}")
    return "\n".join(lines)


def _versions(versions: list[dict[str, Any]]) -> str:
    """`1 draining, 2 ready`, a failed one with its reason."""
    return ", ".join(
        f"{v['version']} {v['state']}" + (f" ({v['reason']})" if v.get("reason") else "") for v in versions
    )


def _settings(settings: dict[str, Any]) -> str:
    return f"({_facts(settings)})"


def _value(spec: Any) -> str:
    """An input or output: dtype and shape (`float32 [-1, 32]`), a structured input's fields in braces,
    and what else the model says of it in parentheses."""
    if not isinstance(spec, dict):
        return json.dumps(jsonable(spec))
    if "dtype" in spec:
        text = f"{spec['dtype']} {json.dumps(spec.get('shape'))}"
        rest = {key: value for key, value in spec.items() if key not in ("dtype", "shape")}
    else:
        fields = {key: value for key, value in spec.items() if isinstance(value, dict)}
        text = "{" + ", ".join(f"{key} {_value(value)}" for key, value in fields.items()) + "}"
        rest = {key: value for key, value in spec.items() if key not in fields}
    return f"{text} ({_facts(rest)})" if rest else text


def _facts(facts: dict[str, Any]) -> str:
    """`key value` pairs, and a flag that is true by its name alone: `kind lstm, vocab_size 1000, random_weights`."""
    return ", ".join(key if value is True else f"{key} {_fact(value)}" for key, value in facts.items())


def _fact(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(jsonable(value))


# The parts of a `models` entry printed a line each: heading, and how one item of the part is shown.
DESCRIBED: dict[str, tuple[str, Callable[[Any], str]]] = {
    "inputs": ("  inputs:  ", _value),
    "outputs": ("  outputs: ", _value),
    "cell_types": ("  cells:   ", _settings),
}


def infer_json(reply: Reply) -> str:
    """The reply for scripts: outputs in full (arrays as nested lists), the timing, and a session's step."""
    printed: dict[str, Any] = {"outputs": reply.outputs, "timing": reply.timing}
    if reply.session_step is not None:
        printed["session_step"] = reply.session_step
    return json.dumps(jsonable(printed))


def stream_item_json(item: Partial | Reply) -> str:
    """A streamed reply for scripts: one JSON object a line, partials marked `partial` (and `restarted`)."""
    if isinstance(item, Reply):
        return infer_json(item)
    return json.dumps(jsonable({"partial": True, "restarted": item.restarted, "outputs": item.outputs}))


def format_stream_item(item: Partial | Reply) -> str:
    """A partial as lines of values (after a notice when the stream started over): a line for a 1-D
    output (Seq2Seq's tokens), one per row for a 2-D one (a chain's `y`); the final reply as usual."""
    if isinstance(item, Reply):
        return format_infer_reply(item)
    lines = ["restarted: the request started over; the partial outputs above are void"] if item.restarted else []
    for name, value in item.outputs.items():
        array = np.asarray(value)
        for row in array.reshape(-1, array.shape[-1]) if array.ndim > 1 else [array.reshape(-1)]:
            shown = [f"{v:.6g}" if np.issubdtype(array.dtype, np.floating) else str(v) for v in row.tolist()]
            lines.append(f"partial {name}: {' '.join(shown)}")
    return "\n".join(lines)


def format_infer_reply(reply: Reply) -> str:
    lines = [f"{name}: {_summarize(value)}" for name, value in reply.outputs.items()]
    lines.append("timing: " + ", ".join(f"{key} {value}" for key, value in reply.timing.items()))
    if reply.session_step is not None:
        lines.append(f"session_step: {reply.session_step}")
    return "\n".join(lines)


def _summarize(value: Any) -> str:
    """Arrays as dtype, shape and their first values; anything else as JSON."""
    if not isinstance(value, np.ndarray):
        return json.dumps(jsonable(value))
    flat = value.reshape(-1)
    floating = np.issubdtype(value.dtype, np.floating)
    shown = [f"{item:.6g}" if floating else str(item) for item in flat[:PREVIEW_VALUES].tolist()]
    more = ", ..." if flat.size > PREVIEW_VALUES else ""
    return f"{value.dtype} shape {list(value.shape)} [{', '.join(shown)}{more}]"


def jsonable(value: Any) -> Any:
    """Make a reply printable as JSON: binary blobs become their length, map keys strings."""
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return value
