"""How the running batch (worker.running_batch) runs the nodes a step chose on its arenas: one gather per kind of
value for their inputs, the cell once, one scatter per kind for their outputs; and a chain run's waves, several
steps of the same lanes, their carried state handed from wave to wave (worker.chain_runs)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from batchmaker.common.ranges import consecutive
from batchmaker.worker.batched_task import KernelClock
from batchmaker.worker.cell_types import CellTypes
from batchmaker.worker.chain_runs import carried, in_place, run_steps
from batchmaker.worker.node_columns import Nodes, PortGroups

Scatters = list[tuple[Any, list[int], bool]]  # per kind of value: its ports, and whether only lanes ending write


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

    def run(self, cell: int, rows: np.ndarray, code: int = 0, state: tuple[torch.Tensor, ...] | None = None,
            ending: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """Run the cell once on the nodes `rows`: gather their inputs (one gather per kind of value: a tree's two
        children's h and c at once), scatter their outputs (one scatter per kind). In a chain run (`code`), the
        inputs it carries come from the wave before's outputs (`state`) after the first wave, and the outputs it
        carries in place are written only for the lanes from position `ending` on, whose run ends at this wave."""
        types, nodes, size = self.types, self.nodes, len(rows)
        spec, arenas = types.specs[cell], types.arenas
        gathers, scatters = self._groups(cell, code, state is not None)
        inputs, outputs = nodes.inputs[rows], nodes.outputs[rows]
        at = [inputs[:, ports].T.ravel() for _, ports in gathers]
        at += [(outputs[ending:] if tail else outputs)[:, ports].T.ravel() for _, ports, tail in scatters]
        index = self._indices(at)
        read: dict[int, torch.Tensor] = {}
        if state is not None:
            read.update((port, state[output][:size]) for port, output in carried(code))
        for (kind, ports), where in zip(gathers, index):
            values = arenas[kind].index_select(0, where)
            by_port = values.view(len(ports), size, *kind.shape).unbind(0) if len(ports) > 1 else [values]
            read.update(zip(ports, by_port))
        args = []
        for port, kind in enumerate(spec.inputs):
            if port in spec.ragged_inputs:
                counts = nodes.ragged_count[rows]
                ragged = nodes.ragged[consecutive(nodes.ragged_start[rows], counts), port]
                args.append(arenas[kind].index_select(0, self.tensor(ragged)))
                args.append(self.tensor(np.repeat(np.arange(size), counts)))
            else:
                args.append(read[port])
        results = types.cells[cell](*args) if self._clock is None else self._clock.call(types.cells[cell], *args)
        if isinstance(results, torch.Tensor):
            results = (results,)
        for (kind, ports, tail), where in zip(scatters, index[len(gathers) :]):
            start = ending if tail else 0
            written = [results[port][start:] for port in ports]
            arenas[kind].index_copy_(0, where, written[0] if len(written) == 1 else torch.cat(written))
        return tuple(results)

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        """An index or value array on the arenas' device (a copy there, from the host, on a GPU)."""
        tensor = torch.from_numpy(array)
        return tensor if self._device.type == "cpu" else tensor.to(self._device)

    def _indices(self, rows: list[np.ndarray]) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
        """Index arrays on the arenas' device: as they are on the CPU, in one copy to a GPU."""
        if self._device.type == "cpu":
            return [torch.from_numpy(array) for array in rows]
        return torch.from_numpy(np.concatenate(rows)).to(self._device).split([len(array) for array in rows])

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
            scatters: Scatters = []
            for kind, ports in self.types.scatters[cell]:
                scatters += [(kind, part, tail) for tail in (False, True)
                             if (part := [p for p in ports if (p in kept) == tail])]  # fmt: skip
            groups = self._ports[key] = (gathers, scatters)
        return groups
