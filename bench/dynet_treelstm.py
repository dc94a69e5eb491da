"""The binary TreeLSTM of common/models/treelstm.py in DyNet, offline: run by the DyNet interpreter.

    python bench/dynet_treelstm.py WEIGHTS.npz TREES.json OUT.json

Imports only numpy and dynet (the interpreter need not have torch or this project). The weights
are the model's weights file as arrays, split by gate (`leaf.weight` rows i, o, u; `internal.weight`
rows i, f_l, f_r, o, u), so every gate is its own parameter. The trees come in evaluation order
(children before parents, the root last) as [token, left, right] rows, -1 for a leaf's children.
Trees run `batch` to a graph with agenda-based autobatching, one thread. OUT gets the trees per
second over every tree after one untimed graph, and the roots' h of that first graph, for a check.
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


class TreeLSTM:
    def __init__(self, weights: dict[str, np.ndarray]):
        self.params = dy.ParameterCollection()
        self.embedding = self.params.lookup_parameters_from_numpy(weights["embedding.weight"])
        self.leaf = self._gates(weights["leaf.weight"], weights["leaf.bias"], LEAF_GATES)
        self.internal = self._gates(weights["internal.weight"], weights["internal.bias"], INTERNAL_GATES)

    def _gates(self, weight: np.ndarray, bias: np.ndarray, names: tuple[str, ...]) -> dict:
        rows = len(bias) // len(names)
        return {
            name: (self.params.parameters_from_numpy(weight[k * rows : (k + 1) * rows]),
                   self.params.parameters_from_numpy(bias[k * rows : (k + 1) * rows]))
            for k, name in enumerate(names)
        }  # fmt: skip

    def graph_parameters(self) -> tuple[dict, dict]:
        """The gates' weights as expressions of the current graph (once per graph, shared by its trees)."""
        return tuple(
            {name: (dy.parameter(w), dy.parameter(b)) for name, (w, b) in gates.items()}
            for gates in (self.leaf, self.internal)
        )

    def tree(self, rows: list[list[int]], leaf: dict, internal: dict) -> dy.Expression:
        """The root's h of one tree, built node by node (DyNet batches the nodes of every tree at forward)."""
        h: list[dy.Expression] = []
        c: list[dy.Expression] = []
        for token, left, right in rows:
            if left < 0:
                x = dy.lookup(self.embedding, token)
                i, o, u = (dy.affine_transform([leaf[g][1], leaf[g][0], x]) for g in LEAF_GATES)
                cell = dy.cmult(dy.logistic(i), dy.tanh(u))
            else:
                x = dy.concatenate([h[left], h[right]])
                i, f_l, f_r, o, u = (dy.affine_transform([internal[g][1], internal[g][0], x]) for g in INTERNAL_GATES)
                cell = (dy.cmult(dy.logistic(i), dy.tanh(u)) + dy.cmult(dy.logistic(f_l), c[left])
                        + dy.cmult(dy.logistic(f_r), c[right]))  # fmt: skip
            h.append(dy.cmult(dy.logistic(o), dy.tanh(cell)))
            c.append(cell)
        return h[-1]


def run_graph(model: TreeLSTM, trees: list[list[list[int]]]) -> list[dy.Expression]:
    """One graph of `trees`, computed with one forward over all their roots."""
    dy.renew_cg()
    leaf, internal = model.graph_parameters()
    roots = [model.tree(rows, leaf, internal) for rows in trees]
    dy.esum([dy.sum_elems(root) for root in roots]).value()
    return roots


def main(weights_path: str, trees_path: str, out_path: str) -> None:
    weights = dict(np.load(weights_path))
    with open(trees_path) as file:
        spec = json.load(file)
    trees, batch = spec["trees"], spec["batch"]
    model = TreeLSTM(weights)
    first = run_graph(model, trees[:batch])  # untimed: memory pools grown, the check's roots
    roots = [root.npvalue().tolist() for root in first]
    start = time.perf_counter()
    for begin in range(0, len(trees), batch):
        run_graph(model, trees[begin : begin + batch])
    seconds = time.perf_counter() - start
    result = {"trees": len(trees), "batch": batch, "seconds": seconds, "trees_per_s": len(trees) / seconds,
              "roots": roots, "dynet": version("dynet")}  # fmt: skip
    with open(out_path, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
