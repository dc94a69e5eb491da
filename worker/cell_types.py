"""What a worker's running batch can run (worker.running_batch): its cell types, with their modules and how their
ports read and write, and the arenas their values live in, one per kind of value. The models the worker started
with come first; a version the manager loads while it runs adds its own, and an unloaded one's modules go."""

from __future__ import annotations

import torch
from torch import nn

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.slots import SlotAllocator
from batchmaker.worker.node_columns import PortGroups, ports_by_kind


class CellTypes:
    """Cell types by index (the order they were added), their modules, and the arenas and free rows per kind."""

    def __init__(self, rows: int, device: torch.device):
        """`rows` per kind of value, on `device` (the cells' own)."""
        self._rows = rows
        self._device = device
        self.specs: list[CellTypeSpec] = []
        self.cells: list[nn.Module | None] = []  # None: a version unloaded, nothing of it runs again
        self.index: dict[str, int] = {}  # by key
        self.kind_index: dict[ValueKind, int] = {}
        self.gathers: list[PortGroups] = []  # per cell type: its input ports by kind (ragged ones left out)
        self.arenas: dict[ValueKind, torch.Tensor] = {}
        self.free: dict[ValueKind, SlotAllocator] = {}
        self.layout: tuple = ()  # what a plan's template in these columns depends on: its key in a plan's cache

    def add(self, specs: list[CellTypeSpec], cells: list[nn.Module], kinds: list[ValueKind]) -> None:
        """Cell types to run, with the kinds of value they read and write (arenas for kinds not seen yet)."""
        for spec, cell in zip(specs, cells, strict=True):
            if spec.key in self.index:
                raise ValueError(f"cell type {spec.key} is already loaded in this running batch")
            self.index[spec.key] = len(self.specs)
            self.specs.append(spec)
            self.cells.append(cell)
            self.gathers.append(ports_by_kind(spec.inputs, skip=spec.ragged_inputs))
        for kind in kinds:
            if kind not in self.kind_index:
                self.kind_index[kind] = len(self.kind_index)
                dtype = getattr(torch, kind.dtype)
                self.arenas[kind] = torch.zeros((self._rows, *kind.shape), dtype=dtype, device=self._device)
                self.free[kind] = SlotAllocator(self._rows)
        self.layout = ("running batch", tuple(self.index), tuple(self.kind_index))

    def drop(self, keys: list[str]) -> None:
        """Let the modules of these cell types go (their version was unloaded: no request of it is held)."""
        for key in keys:
            if key in self.index:
                self.cells[self.index[key]] = None

    @property
    def widths(self) -> tuple[int, int]:
        """The most inputs and outputs a cell type has: the node columns' widths."""
        return max(len(spec.inputs) for spec in self.specs), max(len(spec.outputs) for spec in self.specs)
