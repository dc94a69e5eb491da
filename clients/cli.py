"""Command-line client: `batchmaker-client {infer,models,health,stats,reload} ...`, `models load|unload NAME`.

The subcommands are built by `add_client_commands` and run by `run_client_command`, so the
`batchmaker` entry point mounts the same commands under its own parser, reading `--config` with
the server's config loader; `batchmaker-client` reads it with tomllib alone, without torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cli_output import (
    closed_pipe_ends_quietly,
    format_infer_reply,
    format_models,
    format_stream_item,
    infer_json,
    jsonable,
    stream_item_json,
)
from .cli_server import (
    ADDRESS_ENV,
    CONNECT_TIMEOUT,
    AddressError,
    ConfigAddress,
    Target,
    answering,
    find_target,
    no_server_message,
    toml_server_address,
)
from .errors import ServerError
from .messages import DEFAULT_TIMEOUT, Reply, infer_message, to_infer_reply
from .sync_client import Client
from .text import DEFAULT_VOCAB, Vocabulary

SESSIONS_HELP = (
    "Sessions (chain models): --session NAME continues the state the server keeps for NAME (its first "
    "request starts it from zeros), and the reply prints its session_step. This command keeps nothing "
    "between calls: pass the last session_step you saw with --session-step, so that a server which lost "
    "the session answers SESSION_LOST instead of starting over, and end it with --session-end."
)


class UsageError(Exception):
    """A problem with the command line itself, found before anything is sent."""


def add_client_commands(subparsers: Any) -> None:
    """Add the client subcommands to an `add_subparsers()` object; each sets `client_command`."""
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument(
        "--address",
        action="append",
        help=f"server address, e.g. tcp://127.0.0.1:5555; repeat it to spread requests over several servers "
        f"(default: the --config file's, else ${ADDRESS_ENV}, comma-separated for several)",
    )
    connection.add_argument(
        "--config", type=Path, metavar="FILE", help="the server's TOML config: talk to its [server] address"
    )
    connection.add_argument(
        "--connect-timeout",
        type=float,
        default=CONNECT_TIMEOUT,
        metavar="SECONDS",
        help="seconds to wait for the server to answer a health check before the request; "
        "longer for a server that is starting (default: %(default)g)",
    )
    connection.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds to wait for the reply (default: %(default)g)"
    )
    connection.add_argument(
        "--curve",
        nargs=2,
        metavar=("CLIENT_SECRET_KEY", "SERVER_PUBLIC_KEY"),
        help="key files for a server with CurveZMQ on (see batchmaker keygen)",
    )

    infer = subparsers.add_parser(
        "infer", parents=[connection], help="run one request and print its outputs", epilog=SESSIONS_HELP
    )
    infer.add_argument("--model", required=True, help="name of a served model (see the models command)")
    source = infer.add_mutually_exclusive_group()
    source.add_argument("--tokens", help='token ids separated by spaces, e.g. "1 2 3"')
    source.add_argument("--text", help="an English sentence, turned into ids with --vocab")
    infer.add_argument(
        "--vocab",
        type=Path,
        default=DEFAULT_VOCAB,
        help="vocabulary file for --text, one word per line (default: %(default)s)",
    )
    infer.add_argument(
        "--inputs",
        dest="inputs_json",
        metavar="JSON",
        help='inputs as a JSON object, merged over --tokens/--text, e.g. \'{"max_len": 20}\' or '
        '\'{"tree": {"tokens": [5, 7, -1], "parents": [2, 2, -1]}}\'',
    )
    infer.add_argument(
        "--json", action="store_true", help="print the whole reply as one JSON object, every value in full"
    )
    infer.add_argument("--deadline-ms", type=int, help="give up if not answered within this many milliseconds")
    infer.add_argument("--priority", type=int, help="request priority")
    infer.add_argument(
        "--stream",
        action="store_true",
        help="print the outputs as they become final (Seq2Seq: tokens as they are decoded)",
    )
    infer.add_argument("--session", metavar="NAME", help="continue (or start) the server-held session NAME")
    infer.add_argument("--session-end", action="store_true", help="end the session once this request is answered")
    infer.add_argument(
        "--session-step", type=int, metavar="N", help="the session_step of the session's last reply you saw"
    )
    infer.set_defaults(client_command="infer")

    models = subparsers.add_parser(
        "models", parents=[connection], help="list the served models and their versions, or load or unload one"
    )
    models.add_argument("--json", action="store_true", help="print the whole reply as JSON")
    models.set_defaults(client_command="models")
    actions = models.add_subparsers(dest="models_action", metavar="{load,unload}")
    load = actions.add_parser(
        "load", parents=[connection], help="load a new version of a model (or a new model) while the server runs"
    )
    load.add_argument("name", help="the model's name")
    load.add_argument("--weights", type=Path, metavar="PATH", help="its weights file (default: as it is configured)")
    load.epilog = (
        "--config FILE also names the file whose [models.NAME] table to load (default: the model's table as "
        "the server has it). Paths are read by the server."
    )
    load.set_defaults(client_command="load")
    unload = actions.add_parser("unload", parents=[connection], help="stop serving a model; what it started finishes")
    unload.add_argument("name", help="the model's name")
    unload.set_defaults(client_command="unload")
    subparsers.add_parser(
        "reload", parents=[connection], help="re-read the server's config file and apply its models' changes"
    ).set_defaults(client_command="reload")
    for name, help_text in (
        ("health", "show whether the server is ready and its workers (JSON)"),
        ("stats", "show counters, latency percentiles and batch sizes (JSON)"),
    ):
        subparsers.add_parser(name, parents=[connection], help=help_text).set_defaults(client_command=name)


def run_client_command(args: argparse.Namespace, config_address: ConfigAddress = toml_server_address) -> int:
    """Run a parsed client subcommand; returns the process exit status. `config_address` reads the
    `[server] address` of a `--config` file."""
    try:
        inputs: dict[str, Any] = {}
        if args.client_command == "infer":
            _check_session_options(args)
            inputs = _infer_inputs(args)
        target = find_target(args.address, args.config, config_address)
        with _connect(target, args) as client:
            if not answering(target.addresses, args.connect_timeout, args.curve):
                return _fail("NO_SERVER", no_server_message(target, args.connect_timeout))
            try:
                _run(client, args, inputs)
            except TimeoutError:
                return _fail(
                    "TIMEOUT",
                    f"the server at {' or '.join(target.addresses)} answered a health check, but not the "
                    f"{args.client_command} request within {args.timeout:g} s: it is busy or the request is long "
                    "(--timeout waits longer)",
                )
    except ServerError as exc:
        return _fail(exc.code, exc.message + _vocabulary_hint(args, exc))
    except (UsageError, AddressError) as exc:
        return _fail("USAGE", str(exc))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="batchmaker-client",
        description=f"Talk to a batchmaker server, found with --address, --config FILE or ${ADDRESS_ENV}.",
    )
    add_client_commands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return closed_pipe_ends_quietly(lambda: run_client_command(parser.parse_args(argv)))


def _connect(target: Target, args: argparse.Namespace) -> Client:
    try:
        return Client(target.addresses, args.timeout, curve=args.curve)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _run(client: Client, args: argparse.Namespace, inputs: dict[str, Any]) -> None:
    """Send the subcommand's request and print its reply."""
    command = args.client_command
    if command == "infer" and args.stream:
        for item in client.stream(args.model, inputs, args.deadline_ms, args.priority):
            print(stream_item_json(item) if args.json else format_stream_item(item), flush=True)
    elif command == "infer":
        reply = _infer(client, args, inputs)
        print(infer_json(reply) if args.json else format_infer_reply(reply))
    elif command == "models" and not args.json:
        print(format_models(client.models()))
    elif command in CONTROL_CALLS:
        reply = client.call(CONTROL_CALLS[command](args))
        print(json.dumps(jsonable({key: value for key, value in reply.items() if key not in ("id", "ok")})))
    else:
        reply = getattr(client, command)()
        print(json.dumps(jsonable({key: value for key, value in reply.items() if key not in ("id", "ok")}), indent=2))


def _load(args: argparse.Namespace) -> dict[str, Any]:
    message: dict[str, Any] = {"op": "load", "model": args.name}
    for key in ("weights", "config"):
        if getattr(args, key) is not None:
            message[key] = str(getattr(args, key).resolve())
    return message


# The commands that change what the server serves, and their messages.
CONTROL_CALLS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "load": _load,
    "unload": lambda args: {"op": "unload", "model": args.name},
    "reload": lambda args: {"op": "reload"},
}


def _infer(client: Client, args: argparse.Namespace, inputs: dict[str, Any]) -> Reply:
    """One request; a session's carries the session fields as given, since nothing is kept between calls."""
    if args.session is None:
        return client.infer(args.model, inputs, args.deadline_ms, args.priority)
    fields: dict[str, Any] = {"session": args.session}
    if args.session_end:
        fields["session_end"] = True
    if args.session_step is not None:
        fields["session_step"] = args.session_step
    return to_infer_reply(client.call(infer_message(args.model, inputs, args.deadline_ms, args.priority) | fields))


def _check_session_options(args: argparse.Namespace) -> None:
    if args.session is None and (args.session_end or args.session_step is not None):
        raise UsageError("--session-end and --session-step go with a session: name it with --session NAME")
    if args.session is not None and args.stream:
        raise UsageError("--stream cannot carry a session: leave out --stream or --session")


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
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UsageError(
                f"cannot read the vocabulary {args.vocab} ({reason}); give one with --vocab FILE "
                "(one word per line, line number = id), or the ids with --tokens"
            ) from None
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


def _fail(code: str, message: str) -> int:
    print(f"error {code}: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
