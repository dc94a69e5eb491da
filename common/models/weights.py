"""Reading a weights file and checking it against the model that will serve it.

The supervisor runs these checks before any process starts, so a file that cannot serve the
config fails at once with what was found beside what was expected, and with a remedy that
keeps the user's file: the usual mistakes (other attribute names, a checkpoint dict, a pickled
module, other sizes) each get their own explanation. Only the functions that read tensors import
torch: whether a file holds random weights is read without it, so the manager can say so too.
"""

from __future__ import annotations

import itertools
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchmaker.common.config import ConfigError
from batchmaker.common.models.weights_kind import recognise

if TYPE_CHECKING:
    import torch

    from batchmaker.common.models.base import Model

RANDOM_MARK = "_batchmaker.random_weights"  # `batchmaker init-weights` marks the random files it writes
SHOWN_KEYS = 12  # keys listed per line of a mismatch message


def mark_random(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The state with the mark that tells the server (and its users) the weights are random."""
    import torch

    return {**state, RANDOM_MARK: torch.tensor(seed)}


def is_random(path: Path) -> bool:
    """Whether the weights file was written by `batchmaker init-weights`: the mark is a key of its state
    dict, so its name is in the pickled dict of the file's zip archive (read without torch or tensors)."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickled = next(name for name in archive.namelist() if name.endswith("data.pkl"))
            return RANDOM_MARK.encode() in archive.read(pickled)
    except (OSError, zipfile.BadZipFile, StopIteration):  # unreadable files are reported by read_weights
        return False


def read_weights(model: Model) -> dict[str, torch.Tensor]:
    """The model's tensors from its weights file, in float32; ConfigError saying how to fix the file otherwise."""
    import torch

    path = model.config.weights
    where = _where(model)
    if not path.exists():
        raise ConfigError(
            f"{where} weights file {path} does not exist. Point `weights` at the state dict you saved "
            f"(torch.save(model.state_dict(), PATH); relative paths are relative to the config file). "
            f"Only to try the server with deterministic random weights: batchmaker init-weights {_config(model)}"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many unrelated types for a file that is not its own
        raise ConfigError(_unreadable(where, path, exc)) from None
    if not isinstance(state, dict):
        raise ConfigError(
            f"{where} weights file {path} holds a {type(state).__name__}, not a state dict; "
            "save the model's weights with torch.save(model.state_dict(), PATH)"
        )
    nested = _nested_state_dict(state)
    if nested is not None:
        raise ConfigError(
            f"{where} weights file {path} is a checkpoint dict with keys {sorted(map(str, state))}; "
            f"its state dict is under {nested!r}. Save that alone into a new file and point `weights` at it: "
            f"python -c \"import torch; torch.save(torch.load('{path}', weights_only=True)[{nested!r}], "
            f"'{_sibling(path, 'state')}')\""
        )
    expected = model.weight_shapes()
    _check_keys(model, where, path, state, expected)
    _check_shapes(model, where, path, state, expected)
    return {key: state[key].float() for key in expected}


def _config(model: Model) -> str:
    return str(model.config.config_path or "CONFIG")


def _where(model: Model) -> str:
    return f"{_config(model)}: [models.{model.name}]"


def _sibling(path: Path, suffix: str) -> Path:
    """A new file beside `path`, for a converted copy: the original is never overwritten."""
    return path.with_name(f"{path.stem}-{suffix}{path.suffix}")


def _unreadable(where: str, path: Path, exc: Exception) -> str:
    import torch

    try:
        objects = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not even a torch file
        return f"{where} weights file {path} is not a torch weights file ({type(exc).__name__}: {str(exc)[:200]})"
    modules = [name for name in objects if name.startswith(("torch.nn.modules.", "__main__."))]
    if modules:
        convert = (
            "in the script that defines the class"
            if any(name.startswith("__main__.") for name in modules)
            else f"or convert this file (only if you trust it) into a new one: python -c \"import torch; torch.save("
            f"torch.load('{path}', weights_only=False).state_dict(), '{_sibling(path, 'state')}')\""
        )
        return (
            f"{where} weights file {path} holds a pickled module ({', '.join(modules)}), saved with "
            "torch.save(model); the server reads state dicts only, never code from a file. Save the weights "
            f"alone with torch.save(model.state_dict(), PATH) {convert}, then point `weights` at the new file"
        )
    return (
        f"{where} weights file {path} holds Python objects other than tensors ({', '.join(objects)}); "
        "save a state dict of tensors with torch.save(model.state_dict(), PATH)"
    )


def _nested_state_dict(state: dict[Any, Any]) -> str | None:
    """The key of a checkpoint dict ({"model": state_dict, "epoch": 3}) that holds the tensors."""
    import torch

    if any(isinstance(value, torch.Tensor) for value in state.values()):
        return None
    for key, value in state.items():
        if isinstance(value, dict) and value and all(isinstance(item, torch.Tensor) for item in value.values()):
            return key
    return None


def _check_keys(model: Model, where: str, path: Path, state: dict, expected: dict[str, tuple[int, ...]]) -> None:
    missing = [key for key in expected if key not in state]
    if not missing:
        return
    found = [key for key in state if key != RANDOM_MARK]
    needed = f"{len(missing)} of the {len(expected)} tensors model {model.name!r} ({model.config.builder}) needs"
    lines = [
        f"{where} weights file {path} lacks {needed}:",
        f"  missing:  {_listing(missing)}",
        f"  expected: {_listing(list(expected))}",
        f"  found:    {_listing(found)}",
    ]
    unexpected = [key for key in found if key not in expected]
    lines.append(
        _other_kind(model, path, state, expected)
        or _rename_hint(_prefix_renames(missing, unexpected, state, expected), path)
        or "  Save a state dict with the expected names (docs/models.md lists each model's), or fix the config."
    )
    raise ConfigError("\n".join(lines))


def _rename_hint(renames: dict[str, str], path: Path) -> str | None:
    """For a file of the config's kind whose attribute names differ: the renaming."""
    if not renames:
        return None
    rules = ", ".join(f"{old or '(none)'} -> {new or '(none)'}" for old, new in renames.items())
    return (
        f"  The names differ by prefix: {rules} (the prefix is the module's attribute name). Name the "
        f"attributes as expected, or rename the keys into a new file: {_rename_command(renames, path)}"
    )


def _other_kind(model: Model, path: Path, state: dict, expected: dict[str, tuple[int, ...]]) -> str | None:
    """For a file of another kind than the config's (another builder, an embedding or a head the config
    lacks, other layers), which neither renaming nor sizes would fix: the config that serves it."""
    shapes = {key: tuple(value.shape) for key, value in state.items() if key != RANDOM_MARK and hasattr(value, "shape")}
    found, wanted = recognise(shapes), recognise(expected)
    if found is None or wanted is None or found.layout == wanted.layout:
        return None
    hint = (
        f"  The file holds another kind of model: {found.what}, where the config's model reads {wanted.what}. "
        f"To serve this file, give [models.{model.name}] {found.config_lines()} in place of its sizes"
    )
    renames = {old: new for old, new in found.renames.items() if old != new}
    if not renames:
        return hint + "."
    rules = ", ".join(f"{old or '(none)'} -> {new}" for old, new in renames.items())
    return f"{hint}, and rename its keys ({rules}) into a new file: {_rename_command(found.renames, path)}"


def _rename_command(renames: dict[str, str], path: Path) -> str:
    """A command that writes a copy of the file with its key prefixes renamed (the first that matches)."""
    return (
        f"python -c \"import torch; r = {renames!r}; s = torch.load('{path}', weights_only=True); "
        "torch.save({next((n + k[len(o):] for o, n in r.items() if k.startswith(o)), k): v "
        f"for k, v in s.items()}}, '{_sibling(path, 'renamed')}')\""
    )


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > SHOWN_KEYS else "") if keys else "(none)"


def _prefix_renames(
    missing: list[str], unexpected: list[str], state: dict, expected: dict[str, tuple[int, ...]]
) -> dict[str, str]:
    """Prefix renamings (found -> expected, e.g. "emb." -> "embedding.") that give every missing key,
    pairing keys by their longest common dotted suffix (same shape first); empty when none does."""
    renames: dict[str, str] = {}
    for key in missing:
        candidates = [
            (_common_suffix(key, found), tuple(state[found].shape) == expected[key], found) for found in unexpected
        ]
        candidates = [c for c in candidates if c[0]]
        if not candidates:
            return {}
        suffix, _, found = max(candidates, key=lambda c: (c[1], len(c[0])))
        old, new = found[: len(found) - len(suffix)], key[: len(key) - len(suffix)]
        if renames.setdefault(old, new) != new:
            return {}
    return renames


def _common_suffix(a: str, b: str) -> str:
    """The longest run of whole dotted components both keys end with ("" if the last differs)."""
    parts = list(
        itertools.takewhile(lambda pair: pair[0] == pair[1], zip(reversed(a.split(".")), reversed(b.split("."))))
    )
    return ".".join(part for part, _ in reversed(parts))


def _check_shapes(model: Model, where: str, path: Path, state: dict, expected: dict[str, tuple[int, ...]]) -> None:
    wrong = [
        (key, tuple(state[key].shape), shape) for key, shape in expected.items() if tuple(state[key].shape) != shape
    ]
    if not wrong:
        return
    sizes = ", ".join(
        f"{key} = {value}" for key, value in sorted(model.config.params.items()) if isinstance(value, int)
    )
    details = "; ".join(
        f"{key} is {found} in the file, the config needs {shape}" for key, found, shape in wrong[:SHOWN_KEYS]
    )
    other_kind = _other_kind(model, path, state, expected)
    remedy = (
        f"\n{other_kind}"
        if other_kind
        else f" Set the sizes in [models.{model.name}] to those the weights were trained with."
    )
    raise ConfigError(f"{where} weights file {path} does not fit the config's sizes ({sizes}): {details}.{remedy}")
