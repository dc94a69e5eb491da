"""The model interface in two halves: a planner (numpy) and cells (torch).

A `Planner` is what the manager needs: cell types, `describe`, `unfold` and `plan`, `observe`,
`outputs`, `can_pad`, and `can_stream` with `partial_outputs`. A `Model` is a planner with cells: what workers build
(`make_cells`), what tests and benchmarks compare with (`reference`), and the weights. This module imports
torch only inside the methods that load or save weights, so that a manager serving the
built-in models never loads it: their builder modules define `planner(config)` beside
`build(config)` and hold no torch code (their cells live in `*_cells.py` modules), and the
manager builds planners with `build_planner`. A model whose module defines only `build` is
served as it always was: the manager then runs the whole model's planning half, and imports
whatever that module imports.
"""

from __future__ import annotations

import collections
import functools
import importlib
import logging
import math
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from batchmaker.common.config import ConfigError, ModelConfig
from batchmaker.common.graph import CellGraph, CellTypeSpec, Stop, ValueKind
from batchmaker.common.models.weights import is_random, read_weights
from batchmaker.common.plan import Plan, Unfolded, compile_graph
from batchmaker.common.protocol import (
    BAD_REQUEST,
    INVALID_INPUT,
    RequestError,
    echo,
    is_tensor_map,
    map_to_tensor,
    unknown_names,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FOLD_KEY = "fold_input_projection"  # a built-in model's switch for folded input projections (kernels.py)
FOLD_BUDGET_BYTES = 256 * 2**20  # tables a model may fold by default: vocabulary x gates x 4 bytes
PLANNER_FUNCTION = "planner"  # a builder module's torch-free constructor of the model's planner
PLAN_CACHE_SIZE = 512  # plans a model keeps; a seq2seq plan of 400 + 200 steps is ~74 KB: ~38 MB at most


class PlanCache:
    """Compiled plans by request shape, the least recently used dropped beyond `size`: the shapes
    come from clients, so an unbounded cache would let them fill the manager's memory."""

    def __init__(self, size: int = PLAN_CACHE_SIZE):
        self.size = size
        self.misses = 0
        self._plans: collections.OrderedDict[Hashable, Plan] = collections.OrderedDict()

    def get(self, key: Hashable, compile_plan: Callable[[], Plan]) -> Plan:
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        self.misses += 1
        plan = self._plans[key] = compile_plan()
        if len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return plan

    def snapshot(self) -> dict[str, int]:
        return {"plans": len(self._plans), "size": self.size, "misses": self.misses}


class Planner(ABC):
    """What the manager needs of a model: its cell types, and how a request unfolds and ends
    (docs/models.md, "The interface")."""

    kind: str = ""
    plan_cache: PlanCache | None = None  # models whose requests come in few shapes reuse their plans (`plan`)

    def __init__(self, config: ModelConfig):
        self.config = config
        self.name = config.name

    @functools.cached_property
    def random_weights(self) -> bool:
        """Whether the weights file holds the random weights `batchmaker init-weights` writes (read without torch)."""
        return is_random(self.config.weights)

    # -- description -------------------------------------------------------------------------
    @property
    @abstractmethod
    def cell_types(self) -> dict[str, CellTypeSpec]:
        """Cell types by key ("model/cell")."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """The `models` reply entry: kind, inputs (every input a request may send), outputs, vocab_size."""

    @functools.cached_property
    def declared_inputs(self) -> dict[str, Any]:
        """The inputs a request may send, by name, as `describe()` lists them: a model declares them once, there."""
        return self.describe()["inputs"]

    def check_input_names(self, inputs: Any) -> None:
        """Refuse a request whose inputs are not a map or name an input the model does not declare: a
        misspelt optional input (`max_length` for `max_len`) would otherwise be ignored without a word."""
        if not isinstance(inputs, dict):
            raise RequestError(BAD_REQUEST, "inputs must be a map")
        unknown = unknown_names(inputs, self.declared_inputs.keys(), "input")
        if unknown is not None:
            raise RequestError(
                INVALID_INPUT, f"unknown {unknown} for model {self.name!r}; it takes: {', '.join(self.declared_inputs)}"
            )

    def _cell_type(
        self,
        cell: str,
        inputs: tuple[ValueKind, ...],
        outputs: tuple[ValueKind, ...],
        ragged_inputs: frozenset[int] = frozenset(),
        stop: Stop | None = None,
    ) -> CellTypeSpec:
        settings = self.config.cell_config(cell)
        return CellTypeSpec(
            f"{self.name}/{cell}", inputs, outputs, settings.batch_sizes, settings.priority, ragged_inputs, stop
        )

    # -- serving -----------------------------------------------------------------------------
    @abstractmethod
    def unfold(self, inputs: Any) -> CellGraph:
        """Validate one request's inputs and unfold them into a cell graph.

        Raises RequestError (INVALID_INPUT or BAD_REQUEST) for inputs the model cannot serve.
        """

    can_pad = False  # sequence models that implement unfold_padded (the padded policy needs it)

    def unfold_padded(self, inputs: Any, bucket_width: int) -> CellGraph:
        """Unfold with the sequence padded up to the next multiple of `bucket_width`, which the
        graph records as its `padded_length` (the request's bucket).

        Padding cells compute on a padding token and feed nothing the answer reads, so the
        answer is the unpadded one: this reproduces the wasted work of padding-based batching
        for the `padded` policy, which benchmarks compare against.
        """
        raise NotImplementedError(f"model {self.name!r} cannot be padded")

    def plan(self, inputs: Any) -> Unfolded:
        """The request's compiled plan with its external values (common.plan).

        By default its unfold, compiled: a model whose requests come in a few shapes overrides
        this to reuse one plan per shape, so that admission does no Python work per cell."""
        return compile_graph(self.unfold(inputs), self.cell_types, self.name)

    def plan_padded(self, inputs: Any, bucket_width: int) -> Unfolded:
        """`plan` of `unfold_padded`, for the padded policy."""
        return compile_graph(self.unfold_padded(inputs, bucket_width), self.cell_types, self.name)

    def observe(self, graph: CellGraph | Unfolded, watch_index: int, value: np.ndarray) -> bool:
        """See the host copy of `graph.watch[watch_index]`; return True when the request is complete.

        `graph.state` is the state the unfold put in the graph (the same object in the plan).

        Called in the order the watched nodes complete. Models without watched outputs
        never see this: their requests complete when every result has been read.
        """
        raise NotImplementedError(f"model {self.name!r} watches outputs but does not observe them")

    def outputs(self, graph: CellGraph | Unfolded, results: dict[str, np.ndarray]) -> dict[str, Any]:
        """Turn the host copies of the result values (and what was observed) into the reply's outputs."""
        return results

    can_stream = False  # models that implement partial_outputs: requests may ask for `stream: true`

    def partial_outputs(
        self, graph: CellGraph | Unfolded, results: dict[str, np.ndarray], start: int
    ) -> dict[str, Any] | None:
        """The rows of the streamed outputs from row `start` on that are final now, for a streamed
        request's partial reply (every output the same number of rows), or None when no new row is.

        Called after `observe` and after result values were read, at most once per manager loop
        turn and once more just before the answer; `start` counts the rows already sent. Each
        output's partials, concatenated along their first axis, must equal it in `outputs`."""
        raise NotImplementedError(f"model {self.name!r} cannot stream its outputs")


class Model(Planner):
    """A servable model: its planner and its cells, weights and reference (torch, in workers and tests)."""

    @abstractmethod
    def make_cells(self, state: dict[str, torch.Tensor]) -> dict[str, torch.nn.Module]:
        """Build every cell type's module (weights embedded) from a state dict."""

    def torch_nn_cells(self, state: dict[str, torch.Tensor]) -> dict[str, torch.nn.Module]:
        """The same cells written plainly with torch.nn modules: what benchmarks measure the
        served cells against. Models without faster serving kernels serve these."""
        return self.make_cells(state)

    def folds(self, table_bytes: int) -> bool:
        """Whether the cells fold their token input projections into tables of `table_bytes` in all:
        as the config's `fold_input_projection` says, else when they fit the default budget."""
        setting = self.config.params.get(FOLD_KEY)
        if setting is not None:
            return setting
        if table_bytes <= FOLD_BUDGET_BYTES:
            return True
        log.warning(
            "model %r: folded input projections would take %d MB, over the %d MB budget; "
            "projecting inputs at every step instead (set %s = true to fold anyway)",
            self.name, table_bytes >> 20, FOLD_BUDGET_BYTES >> 20, FOLD_KEY,
        )
        return False

    # -- weights and reference -----------------------------------------------------------------
    @abstractmethod
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the weights file, by key, with the shape this config needs."""

    def init_weights(self, seed: int) -> dict[str, torch.Tensor]:
        """A deterministic random state dict in this model's documented key layout: by default every
        tensor of `weight_shapes()`, uniform in +-1/sqrt(fan-in) as torch.nn initializes its layers."""
        import torch

        generator = torch.Generator().manual_seed(seed)
        return {
            key: (torch.rand(shape, generator=generator) * 2 - 1) / math.sqrt(shape[-1] if shape else 1)
            for key, shape in self.weight_shapes().items()
        }

    def load_weights(self) -> dict[str, torch.Tensor]:
        """The weights file's tensors this model needs, in float32 (ConfigError with the remedy otherwise)."""
        return read_weights(self)

    @abstractmethod
    def reference(self, state: dict[str, torch.Tensor], inputs: Any) -> dict[str, Any]:
        """Unbatched reference: what the served model must return for these inputs."""

    def reference_forward(self, state: dict[str, torch.Tensor]) -> Callable[[Any], dict[str, Any]]:
        """The reference as a function of one request's inputs, its modules built once: timing it times
        the forward alone (`./scripts/bench idle`). Models whose reference builds modules override this."""
        return functools.partial(self.reference, state)


def build_model(config: ModelConfig) -> Model:
    """Import the configured builder ("package.module:function") and build the whole model (planner and cells).

    Errors name the config file: the builder's own ConfigErrors (a missing or misspelt key) too."""
    model = _construct(config, _import_builder(config)[1])
    if not isinstance(model, Model):
        raise ConfigError(f"{_where(config)} builder {config.builder!r} did not return a Model")
    return model


def model_named(name: str, config: ModelConfig) -> Model:
    """The Model class `name` ("package.module:Class") built from `config`. A built-in builder module
    holds the planner and names its cells' module by name: the cells import the planner, never the
    other way, and the planner imports no torch."""
    module_name, _, class_name = name.partition(":")
    return getattr(importlib.import_module(module_name), class_name)(config)


def build_planner(config: ModelConfig) -> Planner:
    """The model's planner: by its builder module's `planner(config)` when it has one (no torch), else
    the whole model."""
    module, builder = _import_builder(config)
    planner = _construct(config, getattr(module, PLANNER_FUNCTION, builder))
    if not isinstance(planner, Planner):
        raise ConfigError(f"{_where(config)} builder {config.builder!r} did not return a Model")
    inputs = planner.describe().get("inputs")
    if not isinstance(inputs, dict) or not all(isinstance(name, str) for name in inputs):
        raise ConfigError(
            f"{_where(config)} builder {config.builder!r}: describe() must map 'inputs' to the model's inputs "
            f"by name (requests may send those only), got {echo(inputs)}"
        )
    return planner


def _where(config: ModelConfig) -> str:
    return f"{config.config_path or 'CONFIG'}: [models.{config.name}]"


def _construct(config: ModelConfig, make: Callable[[ModelConfig], Any]) -> Any:
    try:
        return make(config)
    except ConfigError as exc:
        if config.config_path is None:
            raise
        raise ConfigError(f"{config.config_path}: {exc}") from None


def _import_builder(config: ModelConfig) -> tuple[ModuleType, Callable[[ModelConfig], Any]]:
    """The builder's module and function, with the config's folder and the working directory on the
    import path (after the installed packages, so they never shadow one): every process that builds
    models (supervisor, manager, workers) finds a user's module there without PYTHONPATH."""
    where = _where(config)
    folders = [*([str(config.config_path.parent)] if config.config_path else []), os.getcwd()]
    for folder in folders:
        if folder not in sys.path:
            sys.path.append(folder)
    module_name, _, func_name = config.builder.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{where} cannot import builder {config.builder!r}: {exc}. Modules are looked up in the config's "
            f"folder and the working directory ({', '.join(folders)}) and on PYTHONPATH: move the module to one "
            "of these, or add its folder to PYTHONPATH"
        ) from None
    builder = getattr(module, func_name, None)
    if not callable(builder):
        raise ConfigError(
            f"{where} cannot import builder {config.builder!r}: {module.__file__} defines no function {func_name!r}"
        )
    return module, builder


def cell_layout(models: list[Planner]) -> tuple[list[CellTypeSpec], list[ValueKind]]:
    """Every cell type sorted by key and every value kind sorted by key: the order the manager
    and the workers both use to name cell types and arenas by index."""
    specs = sorted((spec for model in models for spec in model.cell_types.values()), key=lambda s: s.key)
    kinds = sorted({kind for spec in specs for kind in (*spec.inputs, *spec.outputs)}, key=lambda k: k.key)
    return specs, kinds


def padded_length(length: int, bucket_width: int) -> int:
    """The length a sequence is padded to: the end of its bucket, the next multiple of the width."""
    return -(-length // bucket_width) * bucket_width


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def int_param(params: dict[str, Any], key: str, model: str, default: int | None = None, minimum: int = 1) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"[models.{model}] {key} must be an integer >= {minimum}, got {value!r}")
    return value


def check_params(params: dict[str, Any], allowed: set[str], model: str) -> None:
    unknown = set(params) - allowed
    if unknown:
        raise ConfigError(f"[models.{model}] unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    if FOLD_KEY in params and not isinstance(params[FOLD_KEY], bool):
        raise ConfigError(f"[models.{model}] {FOLD_KEY} must be true or false, got {params[FOLD_KEY]!r}")


def token_ids(inputs: Any, key: str, vocab_size: int, max_length: int) -> np.ndarray:
    """Validate a token sequence (a plain int array or an integer tensor map) and return it as int64."""
    if not isinstance(inputs, dict):
        raise RequestError(BAD_REQUEST, "inputs must be a map")
    if key not in inputs:
        raise RequestError(BAD_REQUEST, f"inputs lack {key!r}")
    raw = inputs[key]
    if is_tensor_map(raw):
        array = map_to_tensor(raw, key, rank=1)
        if array.dtype.kind not in "iu":
            raise RequestError(
                INVALID_INPUT, f"{key} must be a 1-D integer tensor, got {array.dtype}{list(array.shape)}"
            )
    elif isinstance(raw, list):
        if len(raw) > max_length:  # before any scan of the list: refusing a long one costs nothing
            raise RequestError(INVALID_INPUT, f"{key} has {len(raw)} tokens; this model accepts at most {max_length}")
        if not set(map(type, raw)) <= {int}:  # bool is not an int here, nor are int subclasses
            raise RequestError(INVALID_INPUT, f"{key} must be a list of integer token ids")
        if raw and 0 <= min(raw) and max(raw) < vocab_size:  # the common case, checked on the list (cheaper)
            return np.array(raw, dtype=np.int64)
        try:
            array = np.array(raw, dtype=np.int64)
        except OverflowError:
            raise RequestError(INVALID_INPUT, f"{key} holds a token id outside 0..{vocab_size - 1}") from None
    else:
        raise RequestError(INVALID_INPUT, f"{key} must be a list of integer token ids")
    if array.size == 0:
        raise RequestError(INVALID_INPUT, f"{key} is empty; send at least one token")
    if array.size > max_length:
        raise RequestError(INVALID_INPUT, f"{key} has {array.size} tokens; this model accepts at most {max_length}")
    if array.min() < 0 or array.max() >= vocab_size:
        position = int(np.argmax((array < 0) | (array >= vocab_size)))
        raise RequestError(
            INVALID_INPUT,
            f"{key}[{position}] = {int(array[position])} is outside the vocabulary; valid ids are 0..{vocab_size - 1}",
        )
    return array.astype(np.int64, copy=False)
