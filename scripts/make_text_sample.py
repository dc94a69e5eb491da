"""Regenerate data/wmt16-ende/sample.en and vocab.en from the WMT16 English training text.

The bundle is derived, not hand-edited, so anyone can check it against the source:

    python scripts/make_text_sample.py [--source DIR] [--out DIR]

sample.en: the first 2000 lines of train.en with the Moses HTML escapes undone.
vocab.en:  <pad> <unk> <s> </s>, then the most frequent lowercased words of all of
           train.en (ties in code-point order), 8192 lines in all.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESERVED = ("<pad>", "<unk>", "<s>", "</s>")  # the ids clients/text.py relies on
SAMPLE_LINES = 2000
VOCAB_SIZE = 8192

# The escapes the Moses tokenizer writes; one pass, so "&amp;apos;" becomes "&apos;" and stops there.
ENTITIES = {
    "&apos;": "'",
    "&quot;": '"',
    "&amp;": "&",
    "&lt;": "<",
    "&gt;": ">",
    "&#124;": "|",
    "&#91;": "[",
    "&#93;": "]",
}
ENTITY_PATTERN = re.compile("|".join(re.escape(entity) for entity in ENTITIES))


def unescape(line: str) -> str:
    return ENTITY_PATTERN.sub(lambda match: ENTITIES[match.group(0)], line)


def read_lines(path: Path) -> list[str]:
    with path.open(encoding="utf-8", newline="\n") as file:
        return [unescape(line.rstrip("\n")) for line in file]


def build_vocabulary(lines: list[str], size: int) -> list[str]:
    counts = Counter(word for line in lines for word in line.lower().split())
    for token in RESERVED:
        counts.pop(token, None)
    ranked = sorted(counts, key=lambda word: (-counts[word], word))
    words = ranked[: size - len(RESERVED)]
    if len(words) < size - len(RESERVED):
        raise SystemExit(f"only {len(counts)} distinct words; cannot fill a vocabulary of {size}")
    return [*RESERVED, *words]


def write_lines(path: Path, lines: list[str]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as file:
        file.writelines(line + "\n" for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT.parent / "shared" / "data" / "wmt16-ende",
                        help="directory holding train.en (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "wmt16-ende",
                        help="directory to write sample.en and vocab.en into (default: %(default)s)")
    args = parser.parse_args(argv)
    lines = read_lines(args.source / "train.en")
    args.out.mkdir(parents=True, exist_ok=True)
    write_lines(args.out / "sample.en", lines[:SAMPLE_LINES])
    write_lines(args.out / "vocab.en", build_vocabulary(lines, VOCAB_SIZE))
    print(f"wrote {min(len(lines), SAMPLE_LINES)} sentences and {VOCAB_SIZE} vocabulary entries to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
