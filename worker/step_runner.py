"""How the running batch (worker.running_batch) runs the nodes a step chose on its arenas: one gather per kind of
value for their inputs, the cell once, one scatter per output; and a chain run's waves, several
steps of the same lanes, their carried state handed from wave to wave (worker.chain_runs)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from batchmaker.common.ranges import consecutive
from batchmaker.worker.batched_task import KernelClock
from batchmaker.worker.cell_types import CellTypes
from batchmaker.worker.chain_runs import carried, in_place, run_steps
from batchmaker.worker.node_columns import Nodes, PortGroups

Scatters = list[tuple[Any, int, bool]]  # per output: its kind of value, its port, and whether only lanes ending write
Outputs = tuple[torch.Tensor, ...]
WaveShape = tuple[tuple[PortGroups, Scatters], int]  # a wave's gathers and scatters, and where its ending lanes start


class StepRunner:
    """Runs chosen nodes on the arenas of `types`, from the rows in `nodes`, on `device`."""

    def __init__(self, types: CellTypes, nodes: Nodes, device: torch.device, clock: KernelClock | None):
        """`clock`, if given, times the cells' calls."""
        self.types = types
        self.nodes = nodes
        self._device = device
        self._clock = clock
        self._ports: dict[tuple[int, int], tuple[PortGroups, Scatters]] = {}  # per (cell, carry code)

    def waves(self, chosen: np.ndarray, limit: int) -> tuple[list[np.ndarray], int]:
        """The chosen nodes' waves: the nodes each step of the run runs, and their links' carry code. Without a
        chain (or with `limit` 1), one wave of them; else their lanes, longest run first, wave after wave, for as
        many waves as half of them or more run (a few long chains do not hold up the others of their cell type)."""
        run = run_steps(self.nodes.chain[chosen], self.nodes.carry[chosen], limit) if limit > 1 else None
        if run is None:
            return [chosen], 0
        steps, code = run
        order = np.argsort(-steps, kind="stable")
        lanes, steps = chosen[order], steps[order]
        steps = np.minimum(steps, steps[(len(steps) - 1) // 2])
        if steps[0] == 1:
            return [chosen], 0
        active = np.searchsorted(-steps, -np.arange(int(steps[0])), side="left").tolist()  # lanes running at wave j
        return [lanes[:running] + wave for wave, running in enumerate(active)], code

    def run(self, cell: int, waves: list[np.ndarray], code: int, copied: list[np.ndarray]) -> list[Outputs]:
        """Run the cell on each wave's nodes in turn (a step of its own is a run of one wave): gather their inputs
        (one gather per kind of value: a tree's two children's h and c at once), scatter their outputs (one scatter
        each, from the cell's own tensor); in a chain run (`code`), the inputs it carries come from the wave before's
        outputs after the first wave, and the outputs it carries in place are written only for the lanes whose run
        ends at that wave. Returns each wave's outputs at the positions `copied[wave]` (the results and watched values
        the host reads).

        Every wave's indices are made before the first cell runs (one copy of them all to a GPU), and the copied
        outputs go to the host after the last: between the cells' calls a wave runs a gather per kind of value, a
        scatter and a copy per output, nothing else (on a CPU a cell's call evicts the Python and numpy around it
        from the caches)."""
        spec, cell_module = self.types.specs[cell], self.types.cells[cell]
        first, later = self._groups(cell, code, False), self._groups(cell, code, True) if len(waves) > 1 else None
        endings = [len(rows) for rows in waves[1:]] + [0]  # per wave: its lanes from here on end their run
        shapes = [(first if wave == 0 else later, ending) for wave, ending in enumerate(endings)]
        index = iter(self._wave_indices(waves, shapes, copied))
        arenas, carries, state = self.types.arenas, carried(code), None
        read_outputs: list[Outputs] = []
        for wave, (rows, ((gathers, scatters), ending)) in enumerate(zip(waves, shapes)):
            size = len(rows)
            read: dict[int, torch.Tensor] = {}
            if state is not None:
                read.update((port, state[output][:size]) for port, output in carries)
            for kind, ports in gathers:
                values = arenas[kind].index_select(0, next(index))
                by_port = values.view(len(ports), size, *kind.shape).unbind(0) if len(ports) > 1 else [values]
                read.update(zip(ports, by_port))
            args = []
            for port, kind in enumerate(spec.inputs):
                if port in spec.ragged_inputs:
                    args += self._ragged(kind, rows, port)
                else:
                    args.append(read[port])
            results = cell_module(*args) if self._clock is None else self._clock.call(cell_module, *args)
            state = (results,) if isinstance(results, torch.Tensor) else tuple(results)
            for kind, port, tail in scatters:  # an output at a time: one scatter of several would copy them first
                arenas[kind].index_copy_(0, next(index), state[port][ending if tail else 0 :])
            if len(copied[wave]):
                at = next(index)
                read_outputs.append(tuple(output.index_select(0, at) for output in state))
        return read_outputs

    def _wave_indices(self, waves: list[np.ndarray], shapes: list[WaveShape], copied: list[np.ndarray]
                      ) -> Iterable[torch.Tensor]:  # fmt: skip
        """The index arrays `run` takes, in the order it takes them: per wave (its gathers and scatters, and where
        the lanes that end their run start) its gathers', its scatters', and the positions of its copied outputs (if
        any); as they are on the CPU, in one copy to a GPU."""
        nodes, arrays = self.nodes, []
        for rows, ((gathers, scatters), ending), at in zip(waves, shapes, copied):
            inputs, outputs = nodes.inputs[rows], nodes.outputs[rows]
            arrays += [inputs[:, ports].T.ravel() for _, ports in gathers]
            arrays += [(outputs[ending:] if tail else outputs)[:, port] for _, port, tail in scatters]
            if len(at):
                arrays.append(at)
        if self._device.type == "cpu":
            return [torch.from_numpy(array) for array in arrays]
        return torch.from_numpy(np.concatenate(arrays)).to(self._device).split([len(array) for array in arrays])

    def _ragged(self, kind: Any, rows: np.ndarray, port: int) -> list[torch.Tensor]:
        """A ragged input's values for the nodes `rows`, all of theirs one after the other, and the node each is of."""
        nodes = self.nodes
        counts = nodes.ragged_count[rows]
        ragged = nodes.ragged[consecutive(nodes.ragged_start[rows], counts), port]
        return [
            self.types.arenas[kind].index_select(0, self.tensor(ragged)),
            self.tensor(np.repeat(np.arange(len(rows)), counts)),
        ]

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        """An index or value array on the arenas' device (a copy there, from the host, on a GPU)."""
        tensor = torch.from_numpy(array)
        return tensor if self._device.type == "cpu" else tensor.to(self._device)

    def _groups(self, cell: int, code: int, later: bool) -> tuple[PortGroups, Scatters]:
        """The gathers and scatters of a wave of `cell` in a run of carry `code` (0: a step of its own), a `later`
        wave's gathers without the carried inputs."""
        key = (cell, code if later else -code)
        groups = self._ports.get(key)
        if groups is None:
            taken = {port for port, _ in carried(code)} if later else set()
            kept = in_place(code)
            gathers = [(kind, [p for p in ports if p not in taken]) for kind, ports in self.types.gathers[cell]]
            gathers = [(kind, ports) for kind, ports in gathers if ports]
            scatters = [(kind, port, port in kept) for port, kind in enumerate(self.types.specs[cell].outputs)]
            groups = self._ports[key] = (gathers, scatters)
        return groups
