"""Binary and Child-Sum TreeLSTM cells against the reference: padded batches, nodes of any arity,
whole trees run the way the server batches them, and weights through a file."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from test_tree_models import SST, VOCAB, model_config, tree

from batchmaker.bench.trees import random_tree
from batchmaker.common.graph import CellGraph, External, NodeOutput, Ragged, Zero
from batchmaker.common.models.base import save_weights
from batchmaker.common.models.childsum_cells import ChildSumTreeLSTMModel
from batchmaker.common.models.sst import load_vocabulary, ptb_to_tree
from batchmaker.common.models.tree import NO_WORD
from batchmaker.common.models.tree_cells import TreeModel
from batchmaker.common.models.treelstm_cells import TreeLSTMModel

TOLERANCE = 1e-5


# -- cells against the reference ---------------------------------------------------------------------


def float64_weights(model: TreeModel, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    state = model.init_weights(seed)
    return state, {key: value.double() for key, value in state.items()}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert float((actual.double() - expected).abs().max()) <= TOLERANCE


PADDING = 2  # rows reading the zero row, as a padded batch has


def test_binary_cells_on_a_padded_batch_equal_the_reference():
    model = TreeLSTMModel(model_config(num_classes=3))
    state, weights = float64_weights(model, 1)
    cells = model.make_cells(state)
    tokens = torch.tensor([4, 0, VOCAB - 1, 4, 17])
    with torch.no_grad():
        h, c = cells["m/leaf"](torch.cat((tokens, torch.zeros(PADDING, dtype=torch.int64))))
        for row, token in enumerate(tokens.tolist()):
            expected_h, expected_c = model.reference_node(weights, token, [])
            assert_close(h[row], expected_h)
            assert_close(c[row], expected_c)
        generator = torch.Generator().manual_seed(2)
        children = torch.randn(4, 6, 8, generator=generator)  # (h_l, c_l, h_r, c_r) for 6 nodes
        padded = torch.cat((children, torch.zeros(4, PADDING, 8)), dim=1)
        h, c = cells["m/internal"](*padded)
        for row in range(6):
            h_l, c_l, h_r, c_r = children[:, row].double()
            expected_h, expected_c = model.reference_node(weights, NO_WORD, [(h_l, c_l), (h_r, c_r)])
            assert_close(h[row], expected_h)
            assert_close(c[row], expected_c)
        logits = cells["m/classifier"](h)
        assert_close(logits[0], weights["classifier.weight"] @ h[0].double() + weights["classifier.bias"])


def test_childsum_cell_batches_nodes_of_any_arity_together():
    """One batch: nodes with 0, 1, 3 and 9 children, with and without a word, then padding rows."""
    model = ChildSumTreeLSTMModel(model_config())
    state, weights = float64_weights(model, 3)
    cell = model.make_cells(state)["m/node"]
    arities = [0, 1, 3, 9, 0, 9, 3]
    tokens = [5, NO_WORD, 7, 12, VOCAB - 1, 0, NO_WORD]
    generator = torch.Generator().manual_seed(4)
    children = [torch.randn(2, k, 8, generator=generator) for k in arities]  # per node: its children's (h, c)
    flat_h = torch.cat([kids[0] for kids in children])
    flat_c = torch.cat([kids[1] for kids in children])
    segments = torch.cat([torch.full((k,), row, dtype=torch.int64) for row, k in enumerate(arities)])
    batch_tokens = torch.tensor(tokens + [0] * PADDING)
    with torch.no_grad():
        h, c = cell(batch_tokens, flat_h, segments, flat_c, segments)
    assert h.shape == c.shape == (len(arities) + PADDING, 8)
    for row, token in enumerate(tokens):
        kids = [(children[row][0, k].double(), children[row][1, k].double()) for k in range(arities[row])]
        expected_h, expected_c = model.reference_node(weights, token, kids)
        assert_close(h[row], expected_h)
        assert_close(c[row], expected_c)


def test_childsum_cell_runs_a_batch_of_leaves_only():
    model = ChildSumTreeLSTMModel(model_config())
    state, weights = float64_weights(model, 6)
    empty = torch.zeros(0, 8)
    none = torch.zeros(0, dtype=torch.int64)
    with torch.no_grad():
        h, c = model.make_cells(state)["m/node"](torch.tensor([3, 0]), empty, none, empty, none)
    expected_h, expected_c = model.reference_node(weights, 3, [])
    assert_close(h[0], expected_h)
    assert_close(c[0], expected_c)


def run_graphs(model: TreeModel, cells: dict[str, torch.nn.Module], graphs: list[CellGraph]) -> list[dict]:
    """Execute graphs the way the server does: every ready node of a cell type, across graphs, in one padded batch."""
    outputs: list[dict[int, tuple[torch.Tensor, ...]]] = [{} for _ in graphs]

    def value(g: int, ref, kind) -> torch.Tensor:
        if isinstance(ref, External):
            return torch.as_tensor(graphs[g].externals[ref.index])
        if isinstance(ref, Zero):
            return torch.zeros(kind.shape, dtype=getattr(torch, kind.dtype))
        return outputs[g][ref.node][ref.port]

    while any(len(out) < len(graph.nodes) for out, graph in zip(outputs, graphs)):
        ready: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for g, graph in enumerate(graphs):
            for index, node in enumerate(graph.nodes):
                refs = [r for ref in node.inputs for r in (ref.refs if isinstance(ref, Ragged) else (ref,))]
                if index not in outputs[g] and all(r.node in outputs[g] for r in refs if isinstance(r, NodeOutput)):
                    ready[node.cell_type].append((g, index))
        for key, batch in ready.items():
            spec = model.cell_types[key]
            args = []
            for port, kind in enumerate(spec.inputs):
                if port in spec.ragged_inputs:
                    node_inputs = [graphs[g].nodes[i].inputs[port] for g, i in batch]
                    rows = [(row, ref) for row, ragged in enumerate(node_inputs) for ref in ragged.refs]
                    flat = [value(batch[row][0], ref, kind) for row, ref in rows]
                    args.append(torch.stack(flat) if flat else torch.zeros(0, *kind.shape))
                    args.append(torch.tensor([row for row, _ in rows], dtype=torch.int64))
                else:
                    column = [value(g, graphs[g].nodes[i].inputs[port], kind) for g, i in batch]
                    args.append(torch.stack(column + [value(0, Zero(), kind)] * PADDING))
            with torch.no_grad():
                result = cells[key](*args)
            result = (result,) if isinstance(result, torch.Tensor) else result
            for row, (g, i) in enumerate(batch):
                outputs[g][i] = tuple(out[row] for out in result)
    return [
        {name: outputs[g][ref.node][ref.port].numpy() for name, ref in graph.results.items()}
        for g, graph in enumerate(graphs)
    ]


def test_binary_model_on_sst_trees_equals_the_reference():
    vocabulary = load_vocabulary(SST / "vocab.txt")
    model = TreeLSTMModel(model_config(vocab_size=len(vocabulary), num_classes=5))
    state = model.init_weights(7)
    lines = (SST / "dev.txt").read_text(encoding="utf-8").splitlines()[:40]
    inputs = []
    for line in lines:
        tokens, parents, _ = ptb_to_tree(line, vocabulary)
        inputs.append(tree(tokens, parents))
    assert_batched_equals_reference(model, state, inputs)


def assert_batched_equals_reference(model, state, inputs) -> None:
    served = run_graphs(model, model.make_cells(state), [model.unfold(i) for i in inputs])
    for got, request in zip(served, inputs):
        expected = model.reference(state, request)
        assert got.keys() == expected.keys() == {"h", "c", "logits"}
        for name in expected:
            assert np.abs(got[name] - expected[name]).max() <= TOLERANCE


def test_childsum_model_on_random_trees_equals_the_reference():
    model = ChildSumTreeLSTMModel(model_config(num_classes=3, max_nodes=200))
    state = model.init_weights(8)
    rng = np.random.default_rng(9)
    inputs = [tree(**random_tree(rng, int(n), VOCAB)) for n in [1, 2, 10, 40, 120, 200, *rng.integers(1, 60, 20)]]
    assert_batched_equals_reference(model, state, inputs)


def test_reference_handles_trees_deeper_than_the_recursion_limit():
    model = ChildSumTreeLSTMModel(model_config(max_nodes=3000))
    chain = tree([i % VOCAB for i in range(3000)], [-1, *range(2999)])  # node i hangs below node i - 1
    assert model.reference(model.init_weights(1), chain)["h"].shape == (8,)


def test_weights_round_trip_through_a_file(tmp_path: Path):
    for model_class in (TreeLSTMModel, ChildSumTreeLSTMModel):
        config = dataclasses.replace(model_config(num_classes=2), weights=tmp_path / "w.pt")
        model = model_class(config)
        state = model.init_weights(11)
        assert {k: tuple(v.shape) for k, v in state.items()} == model.weight_shapes()
        save_weights(state, config.weights)
        loaded = model.load_weights()
        assert all(torch.equal(loaded[k], state[k]) for k in state)
        trained = model.weights_from(loaded)
        assert all(p.requires_grad for p in trained.parameters())
        assert trained.state_dict().keys() == state.keys()
