"""Train the example tagger: Embedding + bidirectional LSTM + Linear on every token, in seconds on a CPU.

    python examples/tagger/train.py [--steps 200] [--seed 0] [--config examples/tagger/tagger.toml]

The task, made from the repo's own English sentences (data/wmt16-ende/sample.en): the server's
vocabulary lowercases words, and the tagger recovers which words were names. A run of capitalized
words after a sentence's first word is a name: its first word is tagged B, the rest I, every other
word O ("... of the Italian Federation of Aerobic Fitness ," -> O O B I O B I O). The sizes come
from the config's [models.tagger] table; the state dict is written to the file its `weights` names,
with the names the server reads (embedding.weight, lstm.weight_ih_l0, ..._reverse, head.weight).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from batchmaker.clients.text import Vocabulary, load_sentences
from batchmaker.common.config import ModelConfig
from examples.training import command_line, fit, save

CONFIG = Path(__file__).with_name("tagger.toml")
TAGS = ("O", "B", "I")
O, B, I = range(len(TAGS))
HELD_OUT = 200  # the last sentences, never trained on
BATCH = 32


def tag_words(words: list[str]) -> list[int]:
    """The rule the tagger learns (see the module docstring)."""
    tags = [O]
    for word in words[1:]:
        if word[:1].isupper():
            tags.append(I if tags[-1] != O else B)
        else:
            tags.append(O)
    return tags


def tagged_sentences(vocabulary: Vocabulary) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids, tags) of every bundled sentence, in file order."""
    return [
        (torch.tensor(vocabulary.encode(line)), torch.tensor(tag_words(line.split())))
        for line in load_sentences()
    ]


class Tagger(nn.Module):
    """The served layout: attribute names are the state dict's prefixes the chain LSTM reads."""

    def __init__(self, vocab_size: int, embedding_size: int, hidden_size: int, num_tags: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.lstm = nn.LSTM(embedding_size, hidden_size, bidirectional=True)
        self.head = nn.Linear(2 * hidden_size, num_tags)

    def forward(self, sentences: list[torch.Tensor]) -> list[torch.Tensor]:
        """Logits [T, num_tags] of each sentence; packed, so a short sentence's backward pass starts at its own end."""
        packed = pack_sequence([self.embedding(tokens) for tokens in sentences], enforce_sorted=False)
        output, lengths = pad_packed_sequence(self.lstm(packed)[0])
        logits = self.head(output)
        return [logits[:length, i] for i, length in enumerate(lengths.tolist())]


def make_tagger(config: ModelConfig) -> Tagger:
    params = config.params
    return Tagger(params["vocab_size"], params["embedding_size"], params["hidden_size"], params["head_size"])


def train(config: ModelConfig, steps: int, seed: int) -> tuple[Tagger, float]:
    """A tagger trained on all but the last HELD_OUT sentences; returns it and the last minibatch's loss."""
    torch.manual_seed(seed)
    tagger = make_tagger(config)
    training = tagged_sentences(Vocabulary())[:-HELD_OUT]
    loss_of = nn.CrossEntropyLoss()

    def batch_loss(rng: np.random.Generator) -> torch.Tensor:
        batch = [training[i] for i in rng.choice(len(training), BATCH, replace=False)]
        logits = tagger([tokens for tokens, _ in batch])
        return loss_of(torch.cat(logits), torch.cat([tags for _, tags in batch]))

    return tagger, fit(tagger, batch_loss, steps, learning_rate=0.01, seed=seed)


def accuracy(tagger: Tagger, sentences: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    with torch.inference_mode():
        predicted = torch.cat([logits.argmax(-1) for logits in tagger([tokens for tokens, _ in sentences])])
    return float((predicted == torch.cat([tags for _, tags in sentences])).float().mean())


def main(argv: list[str] | None = None) -> None:
    config, steps, seed = command_line(__doc__, CONFIG, "tagger", argv)
    tagger, loss = train(config, steps, seed)
    held_out = tagged_sentences(Vocabulary())[-HELD_OUT:]
    all_o = float((torch.cat([tags for _, tags in held_out]) == O).float().mean())
    print(f"last loss {loss:.3f}; held-out token accuracy {accuracy(tagger, held_out):.3f} (all O: {all_o:.3f})")
    save(tagger, config)


if __name__ == "__main__":
    main()
