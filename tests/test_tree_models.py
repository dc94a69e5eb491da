"""Binary and Child-Sum TreeLSTM: SST trees, request validation, unfolding into plans and their lanes.
Their cells against the reference are in tests/test_tree_cells.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, write_config
from harness import Harness

from batchmaker.bench.trees import random_tree
from batchmaker.common.config import CellTypeConfig, ModelConfig
from batchmaker.common.graph import CellGraph, External, NodeOutput, Ragged
from batchmaker.common.models.childsum_cells import ChildSumTreeLSTMModel
from batchmaker.common.models.sst import UNK_ID, load_vocabulary, ptb_to_tree
from batchmaker.common.models.tree import NO_WORD, parse_tree
from batchmaker.common.models.treelstm_cells import TreeLSTMModel
from batchmaker.common.protocol import BAD_REQUEST, INVALID_INPUT, RequestError, tensor_to_map

SST = ROOT / "data" / "sst"
VOCAB = 50


def model_config(**params) -> ModelConfig:
    params = {"vocab_size": VOCAB, "embedding_size": 6, "hidden_size": 8, **params}
    return ModelConfig("m", "unused:build", Path("unused.pt"), params, CellTypeConfig((1, 2, 4), 3), {})


# -- SST trees -------------------------------------------------------------------------------------


def test_ptb_to_tree_numbers_nodes_in_preorder():
    vocabulary = {"<unk>": UNK_ID, "It": 1, "'s": 2, "lovely": 3}
    tokens, parents, labels = ptb_to_tree("(3 (2 It) (4 (2 's) (3 lovely)))", vocabulary)
    assert tokens == [NO_WORD, 1, NO_WORD, 2, 3]
    assert parents == [-1, 0, 0, 2, 2]
    assert labels == [3, 2, 4, 2, 3]
    assert ptb_to_tree("(1 gloomy)", vocabulary) == ([UNK_ID], [-1], [1])


def test_ptb_to_tree_keeps_words_with_non_ascii_spaces_whole():
    tokens, _, _ = ptb_to_tree("(2 (2 its) (2 2\xa01\\/2))", {"2\xa01\\/2": 7, "its": 3})
    assert tokens == [NO_WORD, 3, 7]


@pytest.mark.parametrize(
    "line",
    ["(3 (2 a)", "(2 a))", "(3 a (2 b))", "(3 (2 b) a)", "(x a)", "(2 a) (3 b)", "(2 )", "a", ""],
)
def test_ptb_to_tree_rejects_malformed_lines(line: str):
    with pytest.raises(ValueError):
        ptb_to_tree(line, {})


def test_sst_dev_trees_are_binary_trees_with_labels():
    vocabulary = load_vocabulary(SST / "vocab.txt")
    assert vocabulary["<unk>"] == UNK_ID
    model = TreeLSTMModel(model_config(vocab_size=len(vocabulary), max_nodes=1000))
    lines = (SST / "dev.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1101
    for line in lines:
        tokens, parents, labels = ptb_to_tree(line, vocabulary)
        tree = model.parse({"tree": {"tokens": tokens, "parents": parents}})
        assert tree.root == 0 and labels[0] == int(line[1])
        assert all(0 <= label <= 4 for label in labels)


# -- validation --------------------------------------------------------------------------------------


def tree(tokens, parents) -> dict:
    return {"tree": {"tokens": tokens, "parents": parents}}


INVALID_TREES = [
    ({"tree": [1, 2]}, "must be a map"),
    ({"tree": {"tokens": [1]}}, "lacks 'parents'"),
    ({"tree": {"parents": [-1]}}, "lacks 'tokens'"),
    (tree([1, 2], [-1]), "tree.tokens has 2 entries but tree.parents has 1"),
    (tree([], []), "tree is empty"),
    (tree([1, "2", 3], [-1, 0, 0]), "tree.tokens must be a list of integers"),
    (tree([1, 2, 3], [-1, 0.0, 0]), "tree.parents must be a list of integers"),
    (tree([-1, 2, True], [-1, 0, 0]), "tree.tokens must be a list of integers"),
    (tree("123", [-1, 0, 0]), "tree.tokens must be a list of integers"),
    (tree([-1, 2, 3], [-1, 0, 3]), "tree.parents[2] = 3 is not a node"),
    (tree([-1, 2, 3], [-1, 0, -2]), "tree.parents[2] = -2 is not a node"),
    (tree([-1, 2, 3], [1, 2, 0]), "tree has no root"),
    (tree([-1, 2, 3], [-1, 0, -1]), "tree has 2 roots (nodes 0 and 2"),
    (tree([-1, 2, -1, 4, 5], [-1, 0, 3, 2, 0]), "cycle (2 -> 3 -> 2)"),
    (tree([-1, 2, 3], [-1, 0, 2]), "cycle (2 -> 2)"),
    (tree([-1, VOCAB, 3], [-1, 0, 0]), "tree.tokens[1] = 50 is outside the vocabulary; valid ids are 0..49"),
    (tree([-1, 2, -2], [-1, 0, 0]), "tree.tokens[2] = -2 is outside the vocabulary"),
    (tree([-1, 2, 2**70], [-1, 0, 0]), "is outside the vocabulary"),
    (tree([-1, -1, 3], [-1, 0, 0]), "node 1 is a leaf without a word"),
    (tree([-1] + [1] * 8, [-1] + [0] * 8), "tree has 9 nodes; this model accepts at most 8"),
]
BINARY_ONLY = [
    (tree([-1, 2, 3, 4], [-1, 0, 0, 0]), "node 0 has 3 child(ren); a binary tree needs exactly 2"),
    (tree([-1, 2], [-1, 0]), "node 0 has 1 child(ren)"),
    (tree([1, 2, 3], [-1, 0, 0]), "node 0 is internal but has word 1"),
]


@pytest.mark.parametrize("model_class", [TreeLSTMModel, ChildSumTreeLSTMModel])
@pytest.mark.parametrize("inputs, message", INVALID_TREES)
def test_invalid_trees_are_refused_with_a_useful_message(model_class, inputs, message):
    model = model_class(model_config(max_nodes=8))
    with pytest.raises(RequestError) as error:
        model.unfold(inputs)
    assert error.value.code == INVALID_INPUT
    assert message in error.value.message


@pytest.mark.parametrize("inputs, message", BINARY_ONLY)
def test_binary_model_refuses_non_binary_trees(inputs, message):
    with pytest.raises(RequestError) as error:
        TreeLSTMModel(model_config()).unfold(inputs)
    assert error.value.code == INVALID_INPUT
    assert message in error.value.message
    ChildSumTreeLSTMModel(model_config()).unfold(inputs)  # any arity, words anywhere


@pytest.mark.parametrize("inputs", [[1, 2], {"tokens": [1], "parents": [-1]}])
def test_inputs_without_a_tree_are_bad_requests(inputs):
    with pytest.raises(RequestError) as error:
        parse_tree(inputs, VOCAB, 10, binary=False)
    assert error.value.code == BAD_REQUEST


def test_integer_tensor_maps_are_accepted():
    inputs = tree(tensor_to_map(np.array([-1, 4, 5], dtype=np.int32)), tensor_to_map(np.array([-1, 0, 0])))
    assert parse_tree(inputs, VOCAB, 10, binary=True).children == [[1, 2], [], []]
    inputs["tree"]["tokens"] = tensor_to_map(np.array([-1.0, 4.0, 5.0], dtype=np.float32))
    with pytest.raises(RequestError, match="1-D integer tensor"):
        parse_tree(inputs, VOCAB, 10, binary=True)


def test_parse_orders_children_by_index_and_levels_by_height():
    parsed = parse_tree(tree([-1, 5, -1, 6, 7], [-1, 2, 0, 2, 0]), VOCAB, 10, binary=True)
    assert parsed.root == 0
    assert parsed.children == [[2, 4], [], [1, 3], [], []]
    assert parsed.levels == [[1, 3, 4], [2], [0]]
    assert parsed.order == [1, 3, 4, 2, 0]


# -- unfolding ---------------------------------------------------------------------------------------


def check_topological(graph: CellGraph) -> None:
    for index, node in enumerate(graph.nodes):
        for ref in node.inputs:
            for source in ref.refs if isinstance(ref, Ragged) else (ref,):
                if isinstance(source, NodeOutput):
                    assert source.node < index


def test_binary_unfold_splits_leaves_from_internal_nodes():
    model = TreeLSTMModel(model_config(num_classes=5))
    tokens, parents, _ = ptb_to_tree("(3 (2 It) (4 (2 's) (3 lovely)))", {"It": 1, "'s": 2, "lovely": 3})
    graph = model.unfold(tree(tokens, parents))
    check_topological(graph)
    cell_types = [node.cell_type for node in graph.nodes]
    assert cell_types == ["m/leaf"] * 3 + ["m/internal"] * 2 + ["m/classifier"]
    assert [int(x) for x in graph.externals] == [1, 2, 3]  # leaves in index order
    assert all(node.inputs == (External(i),) for i, node in enumerate(graph.nodes[:3]))
    # node 2 ('s lovely) reads leaves 3 then 4 as left then right; the root reads leaf 1 then node 2
    assert graph.nodes[3].inputs == (NodeOutput(1, 0), NodeOutput(1, 1), NodeOutput(2, 0), NodeOutput(2, 1))
    assert graph.nodes[4].inputs == (NodeOutput(0, 0), NodeOutput(0, 1), NodeOutput(3, 0), NodeOutput(3, 1))
    assert graph.nodes[5].inputs == (NodeOutput(4, 0),)
    assert graph.results == {"h": NodeOutput(4, 0), "c": NodeOutput(4, 1), "logits": NodeOutput(5, 0)}


def test_childsum_unfold_gives_every_node_its_children_on_both_ragged_ports():
    model = ChildSumTreeLSTMModel(model_config(max_nodes=100))
    rng = np.random.default_rng(5)
    for _ in range(20):
        inputs = random_tree(rng, int(rng.integers(1, 60)), VOCAB)
        parsed = model.parse({"tree": inputs})
        graph = model.unfold({"tree": inputs})
        check_topological(graph)
        assert {node.cell_type for node in graph.nodes} == {"m/node"}
        graph_node = {tree_node: index for index, tree_node in enumerate(parsed.order)}
        for tree_node, index in graph_node.items():
            token, h, c = graph.nodes[index].inputs
            assert graph.externals[token.index] == inputs["tokens"][tree_node]
            assert h.refs == tuple(NodeOutput(graph_node[k], 0) for k in parsed.children[tree_node])
            assert c.refs == tuple(NodeOutput(graph_node[k], 1) for k in parsed.children[tree_node])
        root = graph_node[parsed.root]
        assert graph.results == {"h": NodeOutput(root, 0), "c": NodeOutput(root, 1)}


TREE_MODELS = """
[models.bin]
builder = "batchmaker.common.models.treelstm:build"
weights = "bin.pt"
vocab_size = 50
hidden_size = 8
num_classes = 3
batch_sizes = [1, 2, 4]

[models.cs]
builder = "batchmaker.common.models.childsum:build"
weights = "cs.pt"
vocab_size = 50
hidden_size = 8
num_classes = 4
batch_sizes = [1, 2, 4]
"""


def waves(plan) -> list[tuple[str, list[int]]]:
    """Each lane's cell type with the sizes of its waves (nodes of one depth), in order."""
    lanes = []
    for lane, key in enumerate(plan.lane_cells):
        depths = plan.depth[plan.lane_bounds[lane] : plan.lane_bounds[lane + 1]]
        lanes.append((key, np.unique(depths, return_counts=True)[1].tolist()))
    return lanes


def test_lanes_of_a_complete_binary_tree_run_level_by_level(tmp_path: Path):
    """Section 4.4: the 16 leaves run as one batch, then each level of internal nodes, then the classifier."""
    h = Harness(write_config(tmp_path, TREE_MODELS))
    try:
        parents = [-1] + [(i - 1) // 2 for i in range(1, 31)]  # heap order: nodes 15..30 are the leaves
        tokens = [-1] * 15 + list(range(16))
        request = h.admit("bin", tree(tokens, parents))
        assert waves(request.unfolded.plan) == [
            ("bin/leaf", [16]),
            ("bin/internal", [8, 4, 2, 1]),
            ("bin/classifier", [1]),
        ]
        request = h.admit("cs", tree(tokens, parents))
        assert waves(request.unfolded.plan) == [("cs/node", [16, 8, 4, 2, 1]), ("cs/classifier", [1])]
        worker = h.workers[0]
        h.schedule(worker)
        assert [task.nodes for task in h.in_flight(worker)][:1] == [4]  # a full batch of leaves, then more
    finally:
        h.close()


def test_a_one_word_tree_runs_its_leaf_then_its_classifier_and_no_internal_cell(tmp_path: Path):
    """A sentence of one word is a tree without internal nodes: its plan has no internal lane, so
    no internal task runs the classifier's node, and each of its two nodes runs once."""
    h = Harness(write_config(tmp_path, TREE_MODELS))
    try:
        request = h.admit("bin", tree([4], [-1]))
        assert request.unfolded.plan.lane_cells == ("bin/leaf", "bin/classifier")
        worker = h.workers[0]
        ran = []
        while not h.finished:
            while h.schedule(worker):  # everything ready is issued before the worker finishes anything
                pass
            assert h.in_flight(worker), "the request stalled"
            ran.append(h.complete_oldest(worker).spec.key)
        assert ran == ["bin/leaf", "bin/classifier"] and h.finished == [(request, None)]
        assert not h.in_flight(worker), [t.spec.key for t in h.in_flight(worker)]
        assert h.slots_in_use() == 0
    finally:
        h.close()


def test_later_cells_rank_higher_unless_a_config_sets_their_priority():
    model = TreeLSTMModel(model_config(num_classes=2))
    assert {k: s.priority for k, s in model.cell_types.items()} == {"m/leaf": 3, "m/internal": 4, "m/classifier": 5}
    config = dataclasses.replace(model_config(), cells={"internal": CellTypeConfig((1, 8), 1)})
    model = TreeLSTMModel(config)
    assert {k: (s.priority, s.batch_sizes) for k, s in model.cell_types.items()} == {
        "m/leaf": (3, (1, 2, 4)),
        "m/internal": (1, (1, 8)),
    }
    assert model.describe()["outputs"].keys() == {"h", "c"}
    assert ChildSumTreeLSTMModel(model_config(num_classes=4)).describe()["outputs"]["logits"] == {
        "dtype": "float32",
        "shape": [4],
    }


def test_a_full_arena_lets_placed_requests_finish_while_new_ones_wait(tmp_path: Path):
    """Only one tree's rows fit in the arena. The leaf type always has a full batch ready (of trees
    that do not fit yet), yet Schedule must run the placed tree's other cells, or nothing frees rows."""
    h = Harness(write_config(tmp_path, TREE_MODELS), rows=2 + 12)
    try:
        worker = h.workers[0]
        for _ in range(5):
            h.admit("bin", tree([-1, -1, 3, 4, 5], [-1, 0, 1, 1, 0]))  # 5 nodes: 10 rows of h and c
        rounds = 0
        while len(h.finished) < 5 and rounds < 200:
            while worker.in_flight <= 2 and h.schedule(worker):
                pass
            if worker.tasks:
                h.complete_oldest(worker)
            rounds += 1
        assert [error for _, error in h.finished] == [None] * 5
        assert h.slots_in_use() == 0
    finally:
        h.close()


def test_a_plan_whose_node_arrays_disagree_is_refused_when_built():
    """A planner that builds a short array fails its own request at plan time, never the plan store."""
    from batchmaker.common.plan import plan_of

    depth, inputs, outputs = np.zeros(3, np.int64), np.zeros((3, 1), np.int32), np.zeros((3, 1), np.int32)
    ragged = (np.zeros(2, np.int32), np.zeros(2, np.int32), np.zeros((0, 1), np.int32))
    with pytest.raises(ValueError, match="ragged_start has 2 rows for 3 nodes"):
        plan_of([("m/node", 3)], depth, inputs, outputs, ragged, {}, {}, ())
