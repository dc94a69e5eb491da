"""Serving kernels against the plain torch.nn cells they replace, and the fold switch."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from batchmaker.common.config import CellTypeConfig, ConfigError, ModelConfig
from batchmaker.common.models import kernels
from batchmaker.common.models.base import Model
from batchmaker.common.models.chain_cells import GRUModel, LSTMModel
from batchmaker.common.models.childsum_cells import ChildSumTreeLSTMModel
from batchmaker.common.models.seq2seq_cells import Seq2SeqModel
from batchmaker.common.models.tree import NO_WORD
from batchmaker.common.models.treelstm_cells import TreeLSTMModel

TOLERANCE = 1e-5
BATCH = 7
VOCAB = 40


def config(**params) -> ModelConfig:
    return ModelConfig("m", "unused:build", Path("unused.pt"), params, CellTypeConfig((1, 2, 4), 0), {})


CHAIN = {"vocab_size": VOCAB, "embedding_size": 6, "hidden_size": 8, "num_layers": 2}
SEQ2SEQ = {"src_vocab_size": VOCAB, "tgt_vocab_size": VOCAB, "embedding_size": 6, "hidden_size": 8}
TREE = {"vocab_size": VOCAB, "embedding_size": 6, "hidden_size": 8, "num_classes": 3}
MODELS = {
    "lstm": (LSTMModel, CHAIN),
    "gru": (GRUModel, CHAIN),
    "seq2seq": (Seq2SeqModel, SEQ2SEQ),
    "seq2seq_attention": (Seq2SeqModel, {**SEQ2SEQ, "attention": "luong"}),
    "seq2seq_layers_attention": (Seq2SeqModel, {**SEQ2SEQ, "attention": "luong", "num_layers": 2}),
    "treelstm": (TreeLSTMModel, TREE),
    "childsum": (ChildSumTreeLSTMModel, TREE),
}


def batch_inputs(model: Model, key: str, generator: torch.Generator) -> list[torch.Tensor]:
    """A batch as a task hands it to a cell: random tokens (no word included where a cell takes it),
    random states, and for ragged ports 0-3 values per node (children, encoder outputs) with their rows' node index."""
    spec = model.cell_types[key]
    children = torch.randint(0, 4, (BATCH,), generator=generator)
    nodes = torch.repeat_interleave(torch.arange(BATCH), children)
    inputs: list[torch.Tensor] = []
    for port, kind in enumerate(spec.inputs):
        if kind.dtype == "int64":
            tokens = torch.randint(0, VOCAB, (BATCH,), generator=generator)
            if spec.ragged_inputs and model.kind != "seq2seq":  # tree cells take nodes without a word
                tokens[::3] = NO_WORD
            inputs.append(tokens)
        elif port in spec.ragged_inputs:
            inputs += [torch.randn(len(nodes), *kind.shape, generator=generator), nodes]
        else:
            inputs.append(torch.randn(BATCH, *kind.shape, generator=generator))
    return inputs


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_kernel_computes_what_its_torch_nn_cell_does(name: str, fold: bool):
    cls, params = MODELS[name]
    model = cls(config(**params, fold_input_projection=fold))
    state = model.init_weights(3)
    served, plain = model.make_cells(state), model.torch_nn_cells(state)
    assert served.keys() == plain.keys() == model.cell_types.keys()
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for key in served:
            inputs = batch_inputs(model, key, generator)
            got, want = served[key](*inputs), plain[key](*inputs)
            got, want = (
                (got,) if isinstance(got, torch.Tensor) else got,
                (want,) if isinstance(want, torch.Tensor) else want,
            )
            for port, (g, w) in enumerate(zip(got, want, strict=True)):
                assert g.dtype == w.dtype and g.shape == w.shape, (key, port)
                torch.testing.assert_close(g, w, atol=TOLERANCE, rtol=0, msg=f"{key} output {port}")


def folded_tables(cells: dict[str, torch.nn.Module]) -> int:
    return sum(isinstance(module, kernels.TokenTable) for cell in cells.values() for module in cell.modules())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_token_cells_fold_by_default_and_not_when_switched_off(name: str):
    cls, params = MODELS[name]
    token_cells = sum(
        "int64" in (kind.dtype for kind in spec.inputs) for spec in cls(config(**params)).cell_types.values()
    )
    assert folded_tables(cls(config(**params)).make_cells(cls(config(**params)).init_weights(0))) == token_cells
    off = cls(config(**params, fold_input_projection=False))
    assert folded_tables(off.make_cells(off.init_weights(0))) == 0


def test_tables_over_the_budget_are_not_folded_unless_the_config_says_so(monkeypatch, caplog):
    monkeypatch.setattr("batchmaker.common.models.base.FOLD_BUDGET_BYTES", kernels.table_bytes(VOCAB, 4 * 8) - 1)
    auto = LSTMModel(config(**CHAIN))
    with caplog.at_level(logging.WARNING):
        assert folded_tables(auto.make_cells(auto.init_weights(0))) == 0
    assert "over the 0 MB budget" in caplog.text and "fold_input_projection = true" in caplog.text
    forced = LSTMModel(config(**CHAIN, fold_input_projection=True))
    assert folded_tables(forced.make_cells(forced.init_weights(0))) == 1


@pytest.mark.parametrize("value", ["yes", 1, 0])
def test_fold_switch_must_be_a_boolean(value):
    with pytest.raises(ConfigError, match="fold_input_projection must be true or false"):
        LSTMModel(config(**CHAIN, fold_input_projection=value))


def test_a_model_without_the_switch_rejects_it():
    from examples.elman import ElmanModel

    with pytest.raises(ConfigError, match="unknown key"):
        ElmanModel(config(vocab_size=VOCAB, hidden_size=4, fold_input_projection=True))


def test_doubling_tanh_rows_leaves_the_weights_file_untouched():
    weight = torch.arange(12.0).view(6, 2)
    scaled = kernels.doubled(weight, 3, (1,))
    assert torch.equal(weight, torch.arange(12.0).view(6, 2))
    assert torch.equal(scaled[2:4], 2 * weight[2:4]) and torch.equal(scaled[[0, 1, 4, 5]], weight[[0, 1, 4, 5]])


def test_row_argmax_matches_torch_and_keeps_the_first_of_equal_maxima():
    scores = torch.randn(9, 50, generator=torch.Generator().manual_seed(2))
    scores[3, 10] = scores[3, 40] = scores[3].max() + 1  # a tie: the first wins
    scores[5] = 0.0  # all equal
    got = kernels.row_argmax(scores)
    assert got.dtype == torch.int64 and torch.equal(got, scores.argmax(dim=1))
    assert got[3] == 10 and got[5] == 0
    assert torch.equal(kernels.row_argmax(scores.t().contiguous().t()), scores.argmax(dim=1))  # a strided view
