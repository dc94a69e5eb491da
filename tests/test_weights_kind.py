"""A weights file of another kind than its config's (another RNN, no embedding, a head, another model
family) is recognised from its keys and shapes, and refused with the builder and config keys that
serve it, rather than with a renaming or sizes that would lead nowhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_startup_errors import assert_refused, serve, write_config
from torch import nn

from batchmaker.common.models.weights_kind import recognise

GRU_BUILDER = 'builder = "batchmaker.common.models.gru:build"'
LSTM_BUILDER = 'builder = "batchmaker.common.models.lstm:build"'


def shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in module.state_dict().items()}


def chain(rnn: type[nn.Module], name: str, embedding: bool, head: int = 0, **options: object) -> nn.Module:
    """A user's chain model: an optional embedding (50 tokens of size 8; else vectors of size 12), a
    recurrent stack of hidden size 16 under attribute `name`, and an optional head of `head` classes."""
    module = nn.Module()
    if embedding:
        module.embedding = nn.Embedding(50, 8)
    setattr(module, name, rnn(8 if embedding else 12, 16, **options))
    if head:
        module.head = nn.Linear(16 * (2 if options.get("bidirectional") else 1), head)
    return module


def gru_config(folder: Path) -> Path:
    """The user's config with the GRU builder in place of the LSTM's."""
    config = write_config(folder)
    config.write_text(config.read_text().replace(LSTM_BUILDER, GRU_BUILDER))
    return config


def refused(folder: Path, state: dict[str, torch.Tensor], config: Path, *fragments: str) -> str:
    """`batchmaker serve` refusing `config` whose weights file holds `state`: its message, with every fragment."""
    torch.save(state, folder / "trained.pt")
    return assert_refused(serve(config, cwd=folder), *fragments)


LSTM_FILE_UNDER_GRU_CONFIG = [
    (  # the rename lstm. -> gru. would lead to sizes no GRU has
        "lstm",
        (
            "The file holds another kind of model: a 1-layer `nn.LSTM` (`lstm.`) of hidden size 16",
            "where the config's model reads a 1-layer `nn.GRU` (`gru.`)",
            (
                'give [models.mylstm] builder = "batchmaker.common.models.lstm:build", vocab_size = 50, '
                "embedding_size = 8, hidden_size = 16, num_layers = 1, bidirectional = false in place of its sizes."
            ),
        ),
        "rename",
    ),
    (  # every key is there, so the shapes are checked: no size of a GRU fits them
        "gru",
        (
            "does not fit the config's sizes",
            'builder = "batchmaker.common.models.lstm:build"',
            "rename its keys (gru. -> lstm.)",
        ),
        "Set the sizes",
    ),
]


@pytest.mark.parametrize(("attribute", "fragments", "absent"), LSTM_FILE_UNDER_GRU_CONFIG)
def test_an_lstm_file_under_a_gru_config_names_the_lstm_builder_and_keys(
    tmp_path: Path, attribute: str, fragments: tuple[str, ...], absent: str
):
    message = refused(
        tmp_path, chain(nn.LSTM, attribute, embedding=True).state_dict(), gru_config(tmp_path), *fragments
    )
    assert absent not in message


def test_a_gru_tagger_under_an_lstm_config_names_the_gru_builder_input_size_and_head(tmp_path: Path):
    message = refused(
        tmp_path,
        chain(nn.GRU, "rnn", embedding=False, head=5).state_dict(),
        write_config(tmp_path),
        "over float vectors of size 12, with a 5-class head (`head.`)",
        'builder = "batchmaker.common.models.gru:build", input_size = 12, hidden_size = 16, num_layers = 1, '
        "bidirectional = false, head_size = 5",
        "rename its keys (rnn. -> gru.)",
    )
    assert "head. -> embedding." not in message
    command = message[message.index('python -c "') + len('python -c "') : message.rindex('"')]
    subprocess.run([sys.executable, "-c", command], check=True, timeout=60)  # the suggested conversion works
    served = chain(nn.GRU, "gru", embedding=False, head=5).state_dict()
    assert set(torch.load(tmp_path / "trained-renamed.pt", weights_only=True)) == set(served)


def test_a_bare_gru_state_dict_is_named_with_its_prefix(tmp_path: Path):
    refused(
        tmp_path,
        nn.GRU(12, 16, num_layers=2).state_dict(),
        write_config(tmp_path),
        "a bare 2-layer `nn.GRU` state dict of hidden size 16 over float vectors of size 12, without a head",
        "input_size = 12, hidden_size = 16, num_layers = 2, bidirectional = false",
        "rename its keys ((none) -> gru.)",
    )


def test_a_token_lstm_with_an_embedding_and_a_head():
    kind = recognise(shapes(chain(nn.LSTM, "lstm", embedding=True, head=3)))
    assert kind is not None and kind.builder == "batchmaker.common.models.lstm:build"
    assert kind.settings == {
        "vocab_size": 50, "embedding_size": 8, "hidden_size": 16, "num_layers": 1, "bidirectional": False,
        "head_size": 3,
    }
    assert kind.renames == {"embedding.": "embedding.", "lstm.": "lstm.", "head.": "head."}


def test_a_bidirectional_two_layer_gru_under_other_names():
    module = nn.Module()
    module.emb = nn.Embedding(50, 8)
    module.encoder = nn.GRU(8, 16, num_layers=2, bidirectional=True)
    module.fc = nn.Linear(32, 7)
    kind = recognise(shapes(module))
    assert kind is not None and kind.builder == "batchmaker.common.models.gru:build"
    assert kind.settings == {
        "vocab_size": 50, "embedding_size": 8, "hidden_size": 16, "num_layers": 2, "bidirectional": True, "head_size": 7
    }
    assert kind.renames == {"encoder.": "gru.", "emb.": "embedding.", "fc.": "head."}
    assert "2-layer bidirectional `nn.GRU` (`encoder.`)" in kind.what


def test_a_bare_lstm_reads_vectors_and_has_no_prefix():
    kind = recognise(shapes(nn.LSTM(12, 16, bidirectional=True)))
    assert kind is not None and kind.builder == "batchmaker.common.models.lstm:build"
    assert kind.settings == {"input_size": 12, "hidden_size": 16, "num_layers": 1, "bidirectional": True}
    assert kind.renames == {"": "lstm."}
    assert kind.what.startswith("a bare 1-layer bidirectional `nn.LSTM` state dict")


def test_seq2seq_files_are_recognised_with_their_sizes():
    state = {
        "encoder.embedding.weight": (40, 8),
        "decoder.embedding.weight": (30, 8),
        "decoder.projection.weight": (30, 16),
        "decoder.attention.weight": (16, 16),
    }
    for part in ("encoder", "decoder"):
        for layer in range(2):
            state[f"{part}.lstm.weight_ih_l{layer}"] = (64, 8 if layer == 0 else 16)
            state[f"{part}.lstm.weight_hh_l{layer}"] = (64, 16)
    kind = recognise(state)
    assert kind is not None and kind.builder == "batchmaker.common.models.seq2seq:build"
    assert kind.settings == {
        "src_vocab_size": 40, "tgt_vocab_size": 30, "embedding_size": 8, "hidden_size": 16, "num_layers": 2,
        "attention": "luong",
    }


def test_tree_files_are_recognised_by_their_gates():
    binary = {
        "embedding.weight": (50, 8),
        "leaf.weight": (48, 8),
        "internal.weight": (80, 32),
        "classifier.weight": (5, 16),
    }
    kind = recognise(binary)
    assert kind is not None and kind.builder == "batchmaker.common.models.treelstm:build"
    assert kind.settings == {"vocab_size": 50, "embedding_size": 8, "hidden_size": 16, "num_classes": 5}
    childsum = {"embedding.weight": (50, 8), "W.weight": (64, 8), "U_iou.weight": (48, 16), "U_f.weight": (16, 16)}
    kind = recognise(childsum)
    assert kind is not None and kind.builder == "batchmaker.common.models.childsum:build"
    assert kind.settings == {"vocab_size": 50, "embedding_size": 8, "hidden_size": 16, "num_classes": 0}


def test_files_of_no_built_in_kind_are_not_recognised():
    assert recognise({"cell.weight": (48, 16)}) is None
    assert recognise(shapes(nn.RNN(8, 16))) is None  # one gate: no built-in model serves it
