"""The config file's error and the readers of its values, shared by the modules that parse its tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """The configuration file cannot be used as written."""


def subtable(raw: dict[str, Any], key: str, path: Path, where: str | None = None) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: [{where or key}] must be a table")
    return value


def check_keys(table: dict[str, Any], allowed: set[str], where: str, path: Path) -> None:
    unknown = set(table) - allowed
    if unknown:
        raise ConfigError(f"{path}: [{where}] has unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")


def positive_int(table: dict[str, Any], key: str, default: int, where: str, path: Path, minimum: int = 1) -> int:
    value = table.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{path}: [{where}] {key} must be an integer >= {minimum}, got {value!r}")
    return value


def string(table: dict[str, Any], key: str, default: str | None, where: str, path: Path) -> str:
    value = table.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: [{where}] {key} must be a non-empty string, got {value!r}")
    return value


def boolean(table: dict[str, Any], key: str, default: bool, where: str, path: Path) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: [{where}] {key} must be true or false, got {value!r}")
    return value
