"""Command-line client: `python -m batchmaker.clients.cli {infer,models,health,stats} ...`.

The subcommands are built by `add_client_commands` and run by `run_client_command`
so the `batchmaker` entry point can mount the same commands under its own parser.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ServerError
from .streams import Partial
from .sync_client import DEFAULT_ADDRESS, DEFAULT_TIMEOUT, Client, Reply
from .text import DEFAULT_VOCAB, Vocabulary

PREVIEW_VALUES = 8
QUICK_TIMEOUT = 3.0  # models, health, stats: a live server answers at once, so silence means none is there


class UsageError(Exception):
    """A problem with the command line itself, found before anything is sent."""


def add_client_commands(subparsers: Any) -> None:
    """Add the client subcommands to an `add_subparsers()` object; each sets `client_command`."""
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument(
        "--address",
        action="append",
        help=f"server address; repeat it to spread requests over several servers (default: {DEFAULT_ADDRESS})",
    )
    connection.add_argument(
        "--timeout",
        type=float,
        help=f"seconds to wait for the reply (default: {DEFAULT_TIMEOUT:g} for infer, {QUICK_TIMEOUT:g} for the others)",
    )
    connection.add_argument(
        "--curve",
        nargs=2,
        metavar=("CLIENT_SECRET_KEY", "SERVER_PUBLIC_KEY"),
        help="key files for a server with CurveZMQ on (see batchmaker keygen)",
    )

    infer = subparsers.add_parser("infer", parents=[connection], help="run one request and print its outputs")
    infer.add_argument("--model", required=True, help="name of a served model (see the models command)")
    source = infer.add_mutually_exclusive_group()
    source.add_argument("--tokens", help='token ids separated by spaces, e.g. "1 2 3"')
    source.add_argument("--text", help="an English sentence, turned into ids with --vocab")
    infer.add_argument(
        "--vocab", type=Path, default=DEFAULT_VOCAB, help="vocabulary file for --text, one word per line (default: %(default)s)"
    )
    infer.add_argument(
        "--inputs",
        dest="inputs_json",
        metavar="JSON",
        help='inputs as a JSON object, merged over --tokens/--text, e.g. \'{"max_len": 20}\' or '
        '\'{"tree": {"tokens": [5, 7, -1], "parents": [2, 2, -1]}}\'',
    )
    infer.add_argument("--json", action="store_true", help="print the whole reply as one JSON object, every value in full")
    infer.add_argument("--deadline-ms", type=int, help="give up if not answered within this many milliseconds")
    infer.add_argument("--priority", type=int, help="request priority")
    infer.add_argument(
        "--stream", action="store_true", help="print the outputs as they become final (Seq2Seq: tokens as they are decoded)"
    )
    infer.set_defaults(client_command="infer")

    for name, help_text in (
        ("models", "list the served models and their inputs"),
        ("health", "show whether the server is ready and its workers"),
        ("stats", "show counters, latency percentiles and batch sizes"),
    ):
        subparsers.add_parser(name, parents=[connection], help=help_text).set_defaults(client_command=name)


def run_client_command(args: argparse.Namespace) -> int:
    """Run a parsed client subcommand; returns the process exit status."""
    try:
        inputs = _infer_inputs(args) if args.client_command == "infer" else {}
        client = _connect(args)
        with client:
            if args.client_command == "infer" and args.stream:
                for item in client.stream(args.model, inputs, args.deadline_ms, args.priority):
                    print(_stream_item_json(item) if args.json else _format_stream_item(item), flush=True)
            elif args.client_command == "infer":
                reply = client.infer(args.model, inputs, args.deadline_ms, args.priority)
                print(_infer_json(reply) if args.json else _format_infer_reply(reply))
            else:
                reply = getattr(client, args.client_command)()
                shown = {key: value for key, value in reply.items() if key not in ("id", "ok")}
                print(json.dumps(_jsonable(shown), indent=2))
    except ServerError as exc:
        return _fail(exc.code, exc.message + _vocabulary_hint(args, exc))
    except TimeoutError as exc:
        if args.client_command == "infer":
            return _fail("TIMEOUT", str(exc))
        address = " or ".join(args.address or [DEFAULT_ADDRESS])
        return _fail(
            "NO_SERVER",
            f"no server at {address}: nothing answered {args.client_command} within {_timeout(args):g} s; "
            "start one with `batchmaker serve CONFIG`, or name its address with --address (--timeout waits longer)",
        )
    except UsageError as exc:
        return _fail("USAGE", str(exc))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchmaker.clients.cli", description="Talk to a batchmaker server."
    )
    add_client_commands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return run_client_command(parser.parse_args(argv))


def _timeout(args: argparse.Namespace) -> float:
    if args.timeout is not None:
        return args.timeout
    return DEFAULT_TIMEOUT if args.client_command == "infer" else QUICK_TIMEOUT


def _connect(args: argparse.Namespace) -> Client:
    try:
        return Client(args.address or DEFAULT_ADDRESS, _timeout(args), curve=args.curve)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _infer_inputs(args: argparse.Namespace) -> dict[str, Any]:
    inputs: dict[str, Any] = {}
    if args.tokens is not None:
        try:
            inputs["tokens"] = [int(token) for token in re.split(r"[\s,]+", args.tokens.strip()) if token]
        except ValueError:
            raise UsageError(f"--tokens must be integers separated by spaces, got {args.tokens!r}") from None
    elif args.text is not None:
        try:
            inputs["tokens"] = Vocabulary(args.vocab).encode(args.text)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot load the vocabulary: {exc}") from None
    if args.inputs_json is not None:
        try:
            extra = json.loads(args.inputs_json)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--inputs is not valid JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise UsageError("--inputs must be a JSON object mapping input names to values")
        inputs.update(extra)
    if not inputs:
        raise UsageError("give the inputs with --tokens, --text or --inputs")
    return inputs


def _vocabulary_hint(args: argparse.Namespace, error: ServerError) -> str:
    """--text picks ids from a vocabulary the model may not share: say which, when the ids are refused."""
    if getattr(args, "text", None) is None or error.code != "INVALID_INPUT":
        return ""
    return (
        f" (--text turned the sentence into ids with the vocabulary {args.vocab}, {len(Vocabulary(args.vocab))} words; "
        "give the model's own with --vocab FILE, or its ids with --tokens)"
    )


def _infer_json(reply: Reply) -> str:
    """The reply for scripts: outputs in full (arrays as nested lists) and the timing."""
    return json.dumps(_jsonable({"outputs": reply.outputs, "timing": reply.timing}))


def _stream_item_json(item: Partial | Reply) -> str:
    """A streamed reply for scripts: one JSON object a line, partials marked `partial` (and `restarted`)."""
    if isinstance(item, Reply):
        return _infer_json(item)
    return json.dumps(_jsonable({"partial": True, "restarted": item.restarted, "outputs": item.outputs}))


def _format_stream_item(item: Partial | Reply) -> str:
    """A partial as lines of values (after a notice when the stream started over): a line for a 1-D
    output (Seq2Seq's tokens), one per row for a 2-D one (a chain's `y`); the final reply as usual."""
    if isinstance(item, Reply):
        return _format_infer_reply(item)
    lines = ["restarted: the request started over; the partial outputs above are void"] if item.restarted else []
    for name, value in item.outputs.items():
        array = np.asarray(value)
        for row in array.reshape(-1, array.shape[-1]) if array.ndim > 1 else [array.reshape(-1)]:
            shown = [f"{v:.6g}" if np.issubdtype(array.dtype, np.floating) else str(v) for v in row.tolist()]
            lines.append(f"partial {name}: {' '.join(shown)}")
    return "\n".join(lines)


def _format_infer_reply(reply: Reply) -> str:
    lines = [f"{name}: {_summarize(value)}" for name, value in reply.outputs.items()]
    lines.append("timing: " + ", ".join(f"{key} {value}" for key, value in reply.timing.items()))
    return "\n".join(lines)


def _summarize(value: Any) -> str:
    """Arrays as dtype, shape and their first values; anything else as JSON."""
    if not isinstance(value, np.ndarray):
        return json.dumps(_jsonable(value))
    flat = value.reshape(-1)
    floating = np.issubdtype(value.dtype, np.floating)
    shown = [f"{item:.6g}" if floating else str(item) for item in flat[:PREVIEW_VALUES].tolist()]
    more = ", ..." if flat.size > PREVIEW_VALUES else ""
    return f"{value.dtype} shape {list(value.shape)} [{', '.join(shown)}{more}]"


def _jsonable(value: Any) -> Any:
    """Make a reply printable as JSON: binary blobs become their length, map keys strings."""
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return value


def _fail(code: str, message: str) -> int:
    print(f"error {code}: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
