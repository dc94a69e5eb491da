"""What kind of model a weights file holds, read from its keys and shapes alone.

A file of another kind than the config's (an `nn.LSTM` under a GRU config, a tagger without an
embedding under a token model's config) cannot be fixed by renaming its keys or setting sizes:
the user needs another builder, or other config keys. Recognising the file lets the weights check
name both, with the sizes the file was trained with. Shapes only, no torch: the config's own
`weight_shapes()` is recognised the same way, so the two can be compared.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

Shapes = Mapping[str, tuple[int, ...]]
Setting = int | bool | str
Fits = Callable[[tuple[int, ...], tuple[int, ...] | None], bool]  # a weight's shape and its bias's (None without)

RNN_WEIGHT = re.compile(r"^(?P<prefix>.*?)weight_ih_l(?P<layer>\d+)(?P<reverse>_reverse)?$")
RNN_KINDS = {4: "LSTM", 3: "GRU"}  # weight_ih rows per hidden unit: the gates of torch.nn.LSTM / GRU
BUILDERS = "batchmaker.common.models"
LAYOUT_KEYS = ("num_layers", "bidirectional", "attention", "num_classes")  # settings that change the keys, not sizes


@dataclass(frozen=True)
class Kind:
    """A model a weights file can serve: its builder, the config keys that give its sizes, and the
    prefix renamings (found -> the builder's names, longest first) its keys need."""

    builder: str
    what: str  # for messages: "a 1-layer `nn.LSTM` (`lstm.`) of hidden size 16 over ..."
    settings: dict[str, Setting]
    renames: dict[str, str] = field(default_factory=dict)

    @property
    def layout(self) -> tuple[object, ...]:
        """What two kinds share when their keys differ by prefixes and sizes at most."""
        return self.builder, frozenset(self.settings), tuple(self.settings.get(key) for key in LAYOUT_KEYS)

    def config_lines(self) -> str:
        """The model table's keys that serve the file, as TOML."""
        values = {"builder": self.builder, **self.settings}
        return ", ".join(f"{key} = {_toml(value)}" for key, value in values.items())


def recognise(shapes: Shapes) -> Kind | None:
    """The kind of model whose state dict has these keys and shapes; None when no built-in one has them."""
    return _seq2seq(shapes) or _treelstm(shapes) or _childsum(shapes) or _chain(shapes)


def _toml(value: Setting) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f'"{value}"' if isinstance(value, str) else str(value)


def _has(shapes: Shapes, *keys: str) -> bool:
    return all(key in shapes for key in keys)


def _chain(shapes: Shapes) -> Kind | None:
    """A stack of `nn.LSTM` or `nn.GRU` layers under one prefix (or none: a bare module's state dict),
    with an optional embedding before it and an optional linear head after it, under any names."""
    matches = [match for match in map(RNN_WEIGHT.match, shapes) if match]
    prefixes = {match["prefix"] for match in matches}
    if len(prefixes) != 1:
        return None
    prefix = prefixes.pop()
    ih, hh = shapes.get(f"{prefix}weight_ih_l0", ()), shapes.get(f"{prefix}weight_hh_l0", ())
    if len(ih) != 2 or len(hh) != 2 or ih[0] % hh[1]:
        return None
    hidden, inputs = hh[1], ih[1]
    rnn = RNN_KINDS.get(ih[0] // hidden)
    if rnn is None:
        return None
    layers = 1 + max(int(match["layer"]) for match in matches)
    bidirectional = any(match["reverse"] for match in matches)
    own = re.compile(rf"^{re.escape(prefix)}(weight|bias)_(ih|hh)_l\d+(_reverse)?$")
    rest = {key: shape for key, shape in shapes.items() if not own.match(key)}
    embedding = _linear(rest, lambda weight, bias: bias is None and weight[1] == inputs)
    head = _linear(rest, lambda weight, bias: bias == weight[:1] and weight[1] == hidden * (1 + bidirectional))
    module = rnn.lower()
    renames = {prefix: f"{module}."}
    settings: dict[str, Setting] = {}
    if embedding is None:
        settings["input_size"] = inputs
        reads = f"float vectors of size {inputs}"
    else:
        renames[embedding[0]] = "embedding."
        settings |= {"vocab_size": embedding[1][0], "embedding_size": inputs}
        reads = f"token embeddings (`{embedding[0]}`: {embedding[1][0]} tokens of size {inputs})"
    settings |= {"hidden_size": hidden, "num_layers": layers, "bidirectional": bidirectional}
    stack = f"{layers}-layer{' bidirectional' if bidirectional else ''} `nn.{rnn}`"
    stack = f"{stack} (`{prefix}`)" if prefix else f"bare {stack} state dict"
    what = f"a {stack} of hidden size {hidden} over {reads}"
    if head is None:
        what += ", without a head"
    else:
        renames[head[0]] = "head."
        settings["head_size"] = head[1][0]
        what += f", with a {head[1][0]}-class head (`{head[0]}`)"
    return Kind(f"{BUILDERS}.{module}:build", what, settings, _longest_first(renames))


def _linear(shapes: Shapes, fits: Fits) -> tuple[str, tuple[int, ...]] | None:
    """The first `<prefix>weight` matrix whose shape and `<prefix>bias` (None without one) `fits` accepts:
    its prefix and shape."""
    for key, shape in shapes.items():
        if (key == "weight" or key.endswith(".weight")) and len(shape) == 2:
            prefix = key[: -len("weight")]
            if fits(shape, shapes.get(f"{prefix}bias")):
                return prefix, shape
    return None


def _longest_first(renames: dict[str, str]) -> dict[str, str]:
    """Renamings in the order a key tries them, so that `head.` wins over a bare module's `` prefix."""
    return dict(sorted(renames.items(), key=lambda item: -len(item[0])))


def _seq2seq(shapes: Shapes) -> Kind | None:
    """The encoder-decoder of common/models/seq2seq.py, by its documented keys."""
    if not _has(shapes, "encoder.embedding.weight", "decoder.embedding.weight", "encoder.lstm.weight_hh_l0"):
        return None
    hidden = shapes["encoder.lstm.weight_hh_l0"][1]
    layers = sum(1 for key in shapes if RNN_WEIGHT.match(key) and key.startswith("encoder.lstm."))
    settings: dict[str, Setting] = {
        "src_vocab_size": shapes["encoder.embedding.weight"][0],
        "tgt_vocab_size": shapes["decoder.embedding.weight"][0],
        "embedding_size": shapes["encoder.embedding.weight"][1],
        "hidden_size": hidden,
        "num_layers": layers,
    }
    attention = "decoder.attention.weight" in shapes
    if attention:
        settings["attention"] = "luong"
    what = (
        f"a {layers}-layer LSTM encoder-decoder of hidden size {hidden} "
        f"{'with' if attention else 'without'} attention"
    )
    return Kind(f"{BUILDERS}.seq2seq:build", what, settings)


def _treelstm(shapes: Shapes) -> Kind | None:
    """The binary TreeLSTM of common/models/treelstm.py: `leaf.` and `internal.` gates."""
    if not _has(shapes, "embedding.weight", "leaf.weight", "internal.weight"):
        return None
    return _tree(shapes, "treelstm", "a binary TreeLSTM (`leaf.`, `internal.`)", shapes["leaf.weight"][0] // 3)


def _childsum(shapes: Shapes) -> Kind | None:
    """The Child-Sum TreeLSTM of common/models/childsum.py: `W.`, `U_iou.` and `U_f.` gates."""
    if not _has(shapes, "embedding.weight", "W.weight", "U_iou.weight", "U_f.weight"):
        return None
    return _tree(shapes, "childsum", "a Child-Sum TreeLSTM (`W.`, `U_iou.`, `U_f.`)", shapes["U_f.weight"][0])


def _tree(shapes: Shapes, module: str, name: str, hidden: int) -> Kind:
    vocab, embedding = shapes["embedding.weight"]
    classes = shapes.get("classifier.weight", (0,))[0]
    settings: dict[str, Setting] = {
        "vocab_size": vocab,
        "embedding_size": embedding,
        "hidden_size": hidden,
        "num_classes": classes,
    }
    ends = f"a {classes}-class classifier" if classes else "no classifier"
    what = f"{name} of hidden size {hidden} over {vocab} tokens of size {embedding}, with {ends}"
    return Kind(f"{BUILDERS}.{module}:build", what, settings)
