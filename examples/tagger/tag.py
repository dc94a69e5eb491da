"""Tag sentences with the served tagger: prints each word with its tag.

    python examples/tagger/tag.py "The delegation of the European Parliament met in Strasbourg ."
    python examples/tagger/tag.py --address tcp://127.0.0.1:5555 "..." "..."
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from batchmaker.clients import Client
from batchmaker.clients.text import Vocabulary
from examples.tagger.train import TAGS


def tag(client: Client, vocabulary: Vocabulary, sentence: str, model: str = "tagger") -> list[tuple[str, str]]:
    """(word, tag) for every whitespace-separated word: the argmax of the served per-token logits."""
    reply = client.infer(model, {"tokens": vocabulary.encode(sentence)})
    best = np.argmax(reply.outputs["logits"], axis=-1)
    return [(word, TAGS[int(index)]) for word, index in zip(sentence.split(), best)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sentences", nargs="+")
    parser.add_argument("--address", default="tcp://127.0.0.1:5555")
    args = parser.parse_args(argv)
    vocabulary = Vocabulary()
    with Client(args.address) as client:
        for sentence in args.sentences:
            print(" ".join(f"{word}/{label}" for word, label in tag(client, vocabulary, sentence)))


if __name__ == "__main__":
    main()
