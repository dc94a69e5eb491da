"""Train the binary TreeLSTM sentiment model on the Stanford Sentiment Treebank, on CPU.

    python scripts/train_sst.py [--out weights/treelstm-sst.pt] [--budget-minutes 8] [--seed 1]
    python scripts/train_sst.py --write-vocab      # regenerate data/sst/vocab.txt

The shared train.txt is the standard training split with the 1101 dev sentences
appended, so every training sentence that also appears in dev.txt is dropped before
anything else (the vocabulary included). 5% of the rest is held out to pick the best
epoch; dev.txt is only evaluated once, at the end, on the weights that are saved.

Training runs the served cells themselves (TreeLSTMModel.cell_modules), batched level
by level over a minibatch of trees: all leaves in one call, then each tree height in one
call of the internal cell. The loss is the cross-entropy of every node's label, as in
Tai et al. (2015). Dropout applies to h before the classifier only, so the served
cells need none. Results: the weights file (TreeLSTMModel's documented key layout) and
a JSON file beside it with the accuracies and the `[models.NAME]` parameters to serve it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchmaker.common.config import CellTypeConfig, ModelConfig
from batchmaker.common.models.base import save_weights
from batchmaker.common.models.sst import load_vocabulary, ptb_to_tree
from batchmaker.common.models.treelstm_cells import TreeLSTMModel

SST = ROOT / "data" / "sst"
UNK = "<unk>"
NUM_CLASSES = 5
NEUTRAL = 2


def read_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def training_lines(train: Path, dev: Path) -> list[str]:
    """train.txt without the sentences that are also in dev.txt."""
    dev_sentences = set(read_lines(dev))
    return [line for line in read_lines(train) if line not in dev_sentences]


LEAF = re.compile(r"\(\d+ ([^()\x20\t\r\n]+)\)")  # "(label word)", words split as ptb_to_tree does


def write_vocabulary(lines: list[str], path: Path, min_count: int) -> int:
    """`<unk>` then every word seen at least `min_count` times, most frequent first, ties in code-point order."""
    counts = Counter(word for line in lines for word in LEAF.findall(line))
    words = sorted((w for w, n in counts.items() if n >= min_count and w != UNK), key=lambda w: (-counts[w], w))
    path.write_text("".join(f"{word}\n" for word in [UNK, *words]), encoding="utf-8")
    return 1 + len(words)


@dataclass
class Trees:
    """Trees flattened into node arrays: tree t owns nodes starts[t] .. starts[t] + sizes[t] - 1."""

    tokens: np.ndarray
    labels: np.ndarray
    height: np.ndarray
    left: np.ndarray  # a node's left child (global index), -1 for a leaf
    right: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    roots: np.ndarray


def load_trees(lines: list[str], vocabulary: dict[str, int], model: TreeLSTMModel) -> Trees:
    """Convert and validate every line exactly as a request would be, then flatten."""
    columns: dict[str, list[int]] = {"tokens": [], "labels": [], "height": [], "left": [], "right": []}
    starts, sizes, roots = [], [], []
    for line in lines:
        tokens, parents, labels = ptb_to_tree(line, vocabulary)
        tree = model.parse({"tree": {"tokens": tokens, "parents": parents}})
        offset = len(columns["tokens"])
        starts.append(offset)
        sizes.append(len(tokens))
        roots.append(offset + tree.root)
        height = [0] * len(tokens)
        for level, nodes in enumerate(tree.levels):
            for node in nodes:
                height[node] = level
        columns["tokens"] += tokens
        columns["labels"] += labels
        columns["height"] += height
        columns["left"] += [offset + kids[0] if kids else -1 for kids in tree.children]
        columns["right"] += [offset + kids[1] if kids else -1 for kids in tree.children]
    arrays = {key: np.asarray(values, dtype=np.int64) for key, values in columns.items()}
    return Trees(**arrays, starts=np.asarray(starts), sizes=np.asarray(sizes), roots=np.asarray(roots))


@dataclass
class Minibatch:
    """A minibatch's nodes in level order: leaf tokens, each level's children positions, labels, roots."""

    tokens: torch.Tensor
    levels: list[tuple[torch.Tensor, torch.Tensor]]
    labels: torch.Tensor
    roots: torch.Tensor


def minibatch(trees: Trees, chosen: np.ndarray) -> Minibatch:
    """Order the chosen trees' nodes by height, so each level is one contiguous block computed at once."""
    nodes = np.concatenate([np.arange(trees.starts[t], trees.starts[t] + trees.sizes[t]) for t in chosen])
    order = nodes[np.argsort(trees.height[nodes], kind="stable")]
    position = np.empty(len(trees.tokens), dtype=np.int64)
    position[order] = np.arange(len(order))
    counts = np.bincount(trees.height[order])
    bounds = np.concatenate(([0], np.cumsum(counts)))
    levels = []
    for start, end in itertools.pairwise(bounds[1:]):
        block = order[start:end]
        levels.append((torch.from_numpy(position[trees.left[block]]), torch.from_numpy(position[trees.right[block]])))
    leaves = order[: counts[0]]
    return Minibatch(
        torch.from_numpy(trees.tokens[leaves]),
        levels,
        torch.from_numpy(trees.labels[order]),
        torch.from_numpy(position[trees.roots[chosen]]),
    )


def forward(cells: dict[str, nn.Module], batch: Minibatch, dropout: nn.Module) -> torch.Tensor:
    """Logits of every node of the minibatch, in its level order."""
    h, c = cells["leaf"](batch.tokens)
    for left, right in batch.levels:
        h_new, c_new = cells["internal"](h[left], c[left], h[right], c[right])
        h, c = torch.cat((h, h_new)), torch.cat((c, c_new))
    return cells["classifier"](dropout(h))


def root_probabilities(cells: dict[str, nn.Module], trees: Trees, batch_size: int = 256) -> np.ndarray:
    with torch.no_grad():
        chunks = []
        for start in range(0, len(trees.roots), batch_size):
            batch = minibatch(trees, np.arange(start, min(start + batch_size, len(trees.roots))))
            chunks.append(torch.softmax(forward(cells, batch, nn.Identity())[batch.roots], dim=1))
    return torch.cat(chunks).numpy()


def accuracies(probabilities: np.ndarray, labels: np.ndarray) -> dict[str, float | int]:
    """5-class root accuracy, and binary accuracy without neutral sentences: P(0)+P(1) against P(3)+P(4)."""
    fine = float((probabilities.argmax(axis=1) == labels).mean())
    polar = labels != NEUTRAL
    positive = probabilities[:, 3:].sum(axis=1) > probabilities[:, :2].sum(axis=1)
    binary = float((positive[polar] == (labels[polar] > NEUTRAL)).mean())
    return {"fine_grained": fine, "binary": binary, "sentences": len(labels), "binary_sentences": int(polar.sum())}


def train_epoch(
    cells: dict[str, nn.Module],
    optimizer: torch.optim.Optimizer,
    trees: Trees,
    permutation: np.ndarray,
    args: argparse.Namespace,
    dropout: nn.Module,
    deadline: float,
) -> float | None:
    """One pass over the trees in minibatches; the mean node loss, or None if the deadline cut it short."""
    parameters = [p for cell in cells.values() for p in cell.parameters()]
    total, count = 0.0, 0
    for start in range(0, len(permutation), args.batch_size):
        if time.monotonic() > deadline:
            return None
        batch = minibatch(trees, permutation[start : start + args.batch_size])
        loss = nn.functional.cross_entropy(forward(cells, batch, dropout), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(parameters, 5.0)
        optimizer.step()
        total += loss.item() * len(batch.labels)
        count += len(batch.labels)
    return total / count


def train(
    cells: dict[str, nn.Module], weights: nn.Module, train_trees: Trees, holdout: Trees, args: argparse.Namespace,
    started: float,
) -> tuple[float, int, dict[str, torch.Tensor]]:
    """Train for --epochs or until the budget runs out; (held-out accuracy, epoch, weights) of the best epoch."""
    rng = np.random.default_rng(args.seed)
    optimizer = torch.optim.Adam(weights.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    dropout = nn.Dropout(args.dropout)
    deadline = started + 60 * args.budget_minutes
    best: tuple[float, int, dict[str, torch.Tensor]] = (-1.0, 0, {})
    for epoch in range(1, args.epochs + 1):
        permutation = rng.permutation(len(train_trees.roots))
        loss = train_epoch(cells, optimizer, train_trees, permutation, args, dropout, deadline)
        if loss is None:
            print(f"time budget reached during epoch {epoch}; that epoch is not used")
            break
        held = accuracies(root_probabilities(cells, holdout), holdout.labels[holdout.roots])
        print(
            f"epoch {epoch}: node loss {loss:.3f}, held-out root accuracy {held['fine_grained']:.3f} "
            f"(binary {held['binary']:.3f}), {time.monotonic() - started:.0f} s"
        )
        if held["fine_grained"] > best[0]:
            best = (held["fine_grained"], epoch, {k: v.detach().clone() for k, v in weights.state_dict().items()})
    if not best[2]:
        raise SystemExit("the time budget ended before the first epoch; raise --budget-minutes")
    return best


def check_served_model(
    model: TreeLSTMModel, cells: dict[str, nn.Module], trees: Trees, lines: list[str], vocabulary: dict[str, int]
) -> float:
    """Reload the saved file as the server would; compare the reference's root logits with training's forward.

    `trees` are `lines` converted; the comparison covers their first 20.
    """
    state = model.load_weights()
    lines = lines[:20]
    batch = minibatch(trees, np.arange(len(lines)))
    with torch.no_grad():
        trained = forward(cells, batch, nn.Identity())[batch.roots].numpy()
    worst = 0.0
    for row, line in enumerate(lines):
        tokens, parents, _ = ptb_to_tree(line, vocabulary)
        logits = model.reference(state, {"tree": {"tokens": tokens, "parents": parents}})["logits"]
        worst = max(worst, float(np.abs(logits - trained[row]).max()))
    return worst


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=Path, default=SST / "train.txt")
    parser.add_argument("--dev", type=Path, default=SST / "dev.txt")
    parser.add_argument("--vocab", type=Path, default=SST / "vocab.txt")
    parser.add_argument("--write-vocab", action="store_true", help="write --vocab from the training sentences and stop")
    parser.add_argument("--min-count", type=int, default=2, help="with --write-vocab: rarer words become <unk>")
    parser.add_argument("--out", type=Path, default=ROOT / "weights" / "treelstm-sst.pt")
    parser.add_argument("--hidden-size", type=int, default=150)
    parser.add_argument("--embedding-size", type=int, default=150)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--budget-minutes", type=float, default=8.0, help="wall time for the whole run")
    parser.add_argument("--batch-size", type=int, default=25, help="trees per minibatch")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-5)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--holdout", type=float, default=0.05, help="share of training sentences to pick the epoch")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    lines = training_lines(args.train, args.dev)
    if args.write_vocab:
        size = write_vocabulary(lines, args.vocab, args.min_count)
        print(f"wrote {args.vocab}: {size} words from {len(lines)} training sentences")
        return

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # initial weights come from the seed too; this fixes dropout
    vocabulary = load_vocabulary(args.vocab)
    params = {
        "vocab_size": len(vocabulary),
        "embedding_size": args.embedding_size,
        "hidden_size": args.hidden_size,
        "num_classes": NUM_CLASSES,
    }
    builder = "batchmaker.common.models.treelstm:build"
    config = ModelConfig("sst", builder, args.out.resolve(), params, CellTypeConfig((1,), 0), {})
    model = TreeLSTMModel(config)
    shuffled = [lines[i] for i in np.random.default_rng(args.seed).permutation(len(lines))]
    cut = int(len(shuffled) * args.holdout)
    dev_lines = read_lines(args.dev)
    train_trees = load_trees(shuffled[cut:], vocabulary, model)
    holdout = load_trees(shuffled[:cut], vocabulary, model)
    dev = load_trees(dev_lines, vocabulary, model)
    print(
        f"{len(train_trees.roots)} training, {len(holdout.roots)} held-out and {len(dev.roots)} dev sentences; "
        f"{len(vocabulary)} words; {args.threads} threads"
    )

    weights = model.weights_from(model.init_weights(args.seed))
    cells = model.cell_modules(weights)
    held_accuracy, epoch, state = train(cells, weights, train_trees, holdout, args, started)
    weights.load_state_dict(state)
    result = accuracies(root_probabilities(cells, dev), dev.labels[dev.roots])
    save_weights(state, args.out)
    check = check_served_model(model, cells, dev, dev_lines, vocabulary)
    elapsed = time.monotonic() - started
    summary = {
        "dev": result,
        "held_out_fine_grained": held_accuracy,
        "epoch": epoch,
        "training_sentences": len(train_trees.roots),
        "seconds": round(elapsed, 1),
        "seed": args.seed,
        "threads": args.threads,
        "builder": config.builder,
        "params": params,
        "vocab": str(args.vocab),
    }
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"dev root accuracy: 5-class {result['fine_grained']:.4f} ({result['sentences']} sentences), "
        f"binary {result['binary']:.4f} ({result['binary_sentences']} non-neutral sentences); epoch {epoch}"
    )
    print(f"reference check on 20 dev trees: max |logits difference| {check:.2e}")
    print(f"saved {args.out} and {args.out.with_suffix('.json')} after {elapsed:.0f} s")


if __name__ == "__main__":
    main()
