"""The binary TreeLSTM of common/models/treelstm.py in DyNet, offline: run by the DyNet interpreter.

    python bench/dynet_treelstm.py WEIGHTS.npz TREES.json OUT.json

Imports only numpy and dynet (the interpreter need not have torch or this project). The weights
are the model's weights file as arrays (`leaf.weight` rows i, o, u; `internal.weight` rows i, f_l,
f_r, o, u), laid out in one of two gate variants: `split`, every gate its own parameter and affine
transform, or `fused`, one parameter and one affine transform for all of a node's gates, the gates
then picked as row ranges of it. The trees come in evaluation order (children before parents, the
root last) as [token, left, right] rows, -1 for a leaf's children. TREES.json names the variants
to run, each a gate variant and a batch size: trees run `batch` to a graph with agenda-based
autobatching, one thread. OUT gets, per variant, the trees per second over every tree after one
untimed graph, and the roots' h of the first `check` trees of that graph, for a check.
"""

from __future__ import annotations

import json
import sys
import time
from importlib.metadata import version

import dynet_config
import numpy as np

dynet_config.set(mem=2048, autobatch=1)  # autobatch 1: the agenda-based strategy
import dynet as dy  # after dynet_config: dynet reads its configuration at import

LEAF_GATES = ("i", "o", "u")
INTERNAL_GATES = ("i", "f_l", "f_r", "o", "u")
GATE_VARIANTS = ("split", "fused")


class TreeLSTM:
    """The model in one gate variant: `split` (a parameter and an affine transform a gate) or `fused` (one of
    each for all of a node's gates, whose sigmoid gates come first and `u` last, as in the weights file)."""

    def __init__(self, weights: dict[str, np.ndarray], gates: str):
        if gates not in GATE_VARIANTS:
            raise ValueError(f"no gate variant {gates!r} (only {', '.join(GATE_VARIANTS)})")
        self.fused = gates == "fused"
        self.hidden = len(weights["leaf.bias"]) // len(LEAF_GATES)
        self.params = dy.ParameterCollection()
        self.embedding = self.params.lookup_parameters_from_numpy(weights["embedding.weight"])
        self.leaf = self._gates(weights["leaf.weight"], weights["leaf.bias"], LEAF_GATES)
        self.internal = self._gates(weights["internal.weight"], weights["internal.bias"], INTERNAL_GATES)

    def _gates(self, weight: np.ndarray, bias: np.ndarray, names: tuple[str, ...]) -> list:
        """(weight, bias) parameters: one pair for all gates when fused, else one a gate in `names`' order."""
        parts = 1 if self.fused else len(names)
        rows = len(bias) // parts
        return [
            (self.params.parameters_from_numpy(weight[k * rows : (k + 1) * rows]),
             self.params.parameters_from_numpy(bias[k * rows : (k + 1) * rows]))
            for k in range(parts)
        ]  # fmt: skip

    def graph_parameters(self) -> tuple[list, list]:
        """The gates' weights as expressions of the current graph (once per graph, shared by its trees)."""
        return tuple([(dy.parameter(w), dy.parameter(b)) for w, b in gates] for gates in (self.leaf, self.internal))

    def _gate_values(self, gates: list, x: dy.Expression, count: int) -> list[dy.Expression]:
        """A node's `count` gates, each after its nonlinearity: the sigmoid gates, then `u` after tanh."""
        if not self.fused:
            pre = [dy.affine_transform([b, w, x]) for w, b in gates]
            return [dy.logistic(p) for p in pre[:-1]] + [dy.tanh(pre[-1])]
        ((w, b),) = gates
        pre = dy.affine_transform([b, w, x])
        sigmoids = dy.logistic(dy.pick_range(pre, 0, (count - 1) * self.hidden))
        picked = [dy.pick_range(sigmoids, k * self.hidden, (k + 1) * self.hidden) for k in range(count - 1)]
        return picked + [dy.tanh(dy.pick_range(pre, (count - 1) * self.hidden, count * self.hidden))]

    def tree(self, rows: list[list[int]], leaf: list, internal: list) -> dy.Expression:
        """The root's h of one tree, built node by node (DyNet batches the nodes of every tree at forward)."""
        h: list[dy.Expression] = []
        c: list[dy.Expression] = []
        for token, left, right in rows:
            if left < 0:
                i, o, u = self._gate_values(leaf, dy.lookup(self.embedding, token), len(LEAF_GATES))
                cell = dy.cmult(i, u)
            else:
                x = dy.concatenate([h[left], h[right]])
                i, f_l, f_r, o, u = self._gate_values(internal, x, len(INTERNAL_GATES))
                cell = dy.cmult(i, u) + dy.cmult(f_l, c[left]) + dy.cmult(f_r, c[right])
            h.append(dy.cmult(o, dy.tanh(cell)))
            c.append(cell)
        return h[-1]


def run_graph(model: TreeLSTM, trees: list[list[list[int]]]) -> list[dy.Expression]:
    """One graph of `trees`, computed with one forward over all their roots."""
    dy.renew_cg()
    leaf, internal = model.graph_parameters()
    roots = [model.tree(rows, leaf, internal) for rows in trees]
    dy.esum([dy.sum_elems(root) for root in roots]).value()
    return roots


def timed(model: TreeLSTM, trees: list[list[list[int]]], batch: int, check: int) -> dict:
    """Trees per second `batch` to a graph after one untimed graph (its memory pools grown), and the roots of the
    first `check` trees of that graph."""
    first = run_graph(model, trees[:batch])
    roots = [root.npvalue().tolist() for root in first[:check]]
    start = time.perf_counter()
    for begin in range(0, len(trees), batch):
        run_graph(model, trees[begin : begin + batch])
    seconds = time.perf_counter() - start
    return {"batch": batch, "seconds": seconds, "trees_per_s": len(trees) / seconds, "roots": roots}


def main(weights_path: str, trees_path: str, out_path: str) -> None:
    weights = dict(np.load(weights_path))
    with open(trees_path) as file:
        spec = json.load(file)
    trees, models = spec["trees"], {}
    runs = []
    for variant in spec["variants"]:
        gates = variant["gates"]
        if gates not in models:  # one model a gate variant, whatever its batch sizes
            models[gates] = TreeLSTM(weights, gates)
        model = models[gates]
        runs.append({"gates": gates, **timed(model, trees, variant["batch"], spec["check"])})
    with open(out_path, "w") as out:
        json.dump({"trees": len(trees), "runs": runs, "dynet": version("dynet")}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
