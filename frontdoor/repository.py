"""Triton's model repository extension in the server's terms (docs/protocol.md, "Open Inference Protocol",
"Model repository"): the index is the `models` reply's versions with Triton's states, and a load's parameters
become the `load` op's fields.

The server has no repository of model directories: a load names files on the server's own disk, so Triton's
`file:` parameters (model files sent in the request) are refused, and of Triton's `config` (a JSON model
configuration) only its `parameters` that name those files are taken.
"""

from __future__ import annotations

import json
from typing import Any

from batchmaker.common.protocol import INVALID_INPUT, echo

from .errors import DoorError

# The server's version states as Triton's, with the reason Triton's index gives beside a state that does not serve.
STATES: dict[str, tuple[str, str]] = {
    "loading": ("LOADING", ""),
    "ready": ("READY", ""),
    "draining": ("UNLOADING", "draining: it finishes the requests it started, then unloads"),
    "unloaded": ("UNAVAILABLE", "unloaded"),
    "failed": ("UNAVAILABLE", ""),  # the reason is the server's, why it failed
}
LOAD_FIELDS = {"weights": "weights", "config_file": "config"}  # a load parameter -> the `load` op's field


def index(models: dict[str, Any], ready_only: bool) -> list[dict[str, str]]:
    """Each version of each model the server ever loaded, from a `models` reply, as Triton's index entries."""
    listings = {**models.get("unloaded", {}), **{name: entry["versions"] for name, entry in models["models"].items()}}
    entries = []
    for name in sorted(listings):
        for version in listings[name]:
            state, reason = STATES[version["state"]]
            if ready_only and state != "READY":
                continue
            entries.append(
                {
                    "name": name,
                    "version": str(version["version"]),
                    "state": state,
                    "reason": version.get("reason", reason),
                }
            )
    return entries


def ready_versions(entry: dict[str, Any]) -> list[str]:
    """The versions of a `models` entry that serve, oldest first."""
    return [str(version["version"]) for version in entry.get("versions", []) if version["state"] == "ready"]


def load_fields(model: str, parameters: dict[str, Any]) -> dict[str, str]:
    """The `load` op's fields for a load's parameters: `weights` and `config_file` (paths on the server's host),
    given as parameters of their own or inside Triton's `config` JSON as `parameters` with a `string_value`."""
    given = {key: value for key, value in parameters.items() if key != "config"}
    if "config" in parameters:
        for key, value in _config_parameters(model, parameters["config"]).items():
            if key in given:
                raise DoorError(INVALID_INPUT, f"load parameter {echo(key)} is given twice: alone and in 'config'")
            given[key] = value
    fields = {}
    for key, value in given.items():
        if key.startswith("file:"):
            raise DoorError(
                INVALID_INPUT,
                f"{echo(key)}: the server loads files from its own disk, not from the request; "
                "give the weights file's path in the parameter 'weights'",
            )
        if key not in LOAD_FIELDS:
            raise DoorError(
                INVALID_INPUT, f"unknown load parameter {echo(key)}; a load takes: weights, config_file, config"
            )
        if not isinstance(value, str) or not value:
            raise DoorError(INVALID_INPUT, f"load parameter {key} must be a path (a string), got {echo(value)}")
        fields[LOAD_FIELDS[key]] = value
    return fields


def _config_parameters(model: str, text: Any) -> dict[str, Any]:
    """The string `parameters` of Triton's `config`, a JSON model configuration of which nothing else applies."""
    try:
        config = json.loads(text) if isinstance(text, str) else None
    except ValueError as exc:
        raise DoorError(INVALID_INPUT, f"load parameter config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise DoorError(INVALID_INPUT, "load parameter config must be a JSON object, as a string")
    others = sorted(set(config) - {"name", "parameters"})
    if others:
        raise DoorError(
            INVALID_INPUT,
            f"config's {echo(others[0])} has no meaning here: the model's table in the server's config sets "
            "what Triton's model configuration would; config takes 'parameters' (weights, config_file)",
        )
    if config.get("name", model) != model:
        raise DoorError(INVALID_INPUT, f"config names model {echo(config['name'])}, not {model!r}")
    parameters = config.get("parameters", {})
    if not isinstance(parameters, dict):
        raise DoorError(INVALID_INPUT, "config's parameters must be an object")
    values = {}
    for key, value in parameters.items():
        if not isinstance(value, dict) or not isinstance(value.get("string_value"), str):
            raise DoorError(INVALID_INPUT, f'config parameter {echo(key)} must be {{"string_value": "..."}}')
        values[key] = value["string_value"]
    return values
