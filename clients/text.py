"""Turning English sentences into token ids for the demo, the command-line client and benchmarks.

The bundled sentences (data/wmt16-ende) are already tokenized, so a sentence is
lowercased and split on whitespace; there is no subword model to load.
"""

from __future__ import annotations

from pathlib import Path

PAD, UNK, BOS, EOS = 0, 1, 2, 3
RESERVED = ("<pad>", "<unk>", "<s>", "</s>")

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "wmt16-ende"  # in a checkout, or an editable install
# The batchmaker-client distribution installs the vocabulary (65 KB) in this package, for --text out of the box.
INSTALLED_VOCAB = Path(__file__).resolve().parent / "vocabulary" / "vocab.en"
DEFAULT_VOCAB = DATA_DIR / "vocab.en" if (DATA_DIR / "vocab.en").exists() else INSTALLED_VOCAB
DEFAULT_SENTENCES = DATA_DIR / "sample.en"


class Vocabulary:
    """Word → id map read from a file with one token per line (line number = id).

    The first four lines must be the reserved tokens, so id 1 is always `<unk>`
    whatever file is loaded.
    """

    def __init__(self, path: str | Path = DEFAULT_VOCAB):
        tokens = _read_lines(Path(path))
        if tuple(tokens[: len(RESERVED)]) != RESERVED:
            raise ValueError(f"{path}: the first lines must be the reserved tokens {' '.join(RESERVED)}")
        self.tokens = tokens
        self.ids = {token: index for index, token in enumerate(tokens)}
        if len(self.ids) != len(tokens):
            raise ValueError(f"{path}: a token is listed twice, so its id would be ambiguous")

    def encode(self, sentence: str) -> list[int]:
        """Ids of the lowercased, whitespace-separated words; unknown words become `<unk>`."""
        return [self.ids.get(word, UNK) for word in sentence.lower().split()]

    def __len__(self) -> int:
        return len(self.tokens)


def load_sentences(path: str | Path = DEFAULT_SENTENCES) -> list[str]:
    """The non-blank lines of a text file: a blank line would be an empty, invalid request."""
    return [line for line in _read_lines(Path(path)) if line.strip()]


def _read_lines(path: Path) -> list[str]:
    # Split on "\n" only: str.splitlines would also break lines at characters such as U+2028.
    text = path.read_text(encoding="utf-8")
    return text.removesuffix("\n").split("\n") if text else []
