"""The benchmark presets: which model, which dataset, which policies, and the load sweep.

CPU sizing (docs/architecture.md, "Sizing on a CPU"): hidden 256 and b_max 64 for every cell, one worker with
one intra-op thread, so the manager, the worker and the load generator share two cores.
"""

from __future__ import annotations

from dataclasses import dataclass

B_MAX = 64
BATCH_SIZES = "[1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]"

LSTM = f"""
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
weights = "{{weights}}/bench-lstm-h256.pt"
vocab_size = 8192
embedding_size = 256
hidden_size = 256
max_length = 400
batch_sizes = {BATCH_SIZES}
"""

SEQ2SEQ = f"""
[models.seq2seq]
builder = "batchmaker.common.models.seq2seq:build"
weights = "{{weights}}/bench-seq2seq-h256.pt"
src_vocab_size = 8192
tgt_vocab_size = 4096
embedding_size = 256
hidden_size = 256
max_length = 400
max_decode_length = 200
batch_sizes = {BATCH_SIZES}

[models.seq2seq.cells.decoder]
priority = 1
"""

# The same Seq2Seq with Luong attention: each decoder step reads its request's encoder outputs.
SEQ2SEQ_ATTENTION = SEQ2SEQ.replace("bench-seq2seq-h256.pt", "bench-seq2seq-luong-h256.pt").replace(
    "max_decode_length = 200\n", 'max_decode_length = 200\nattention = "luong"\n'
)
TAGGER = f"""
[models.tagger]
builder = "batchmaker.common.models.lstm:build"
weights = "{{weights}}/bench-tagger-h256.pt"
vocab_size = 8192
embedding_size = 256
hidden_size = 256
bidirectional = true
per_step = true
head_size = 9
max_length = 400
batch_sizes = {BATCH_SIZES}
"""

# The same one-layer chain with GRU cells (the idle preset's GRU row).
GRU = (
    LSTM.replace("[models.lstm]", "[models.gru]")
    .replace("batchmaker.common.models.lstm:build", "batchmaker.common.models.gru:build")
    .replace("bench-lstm-h256.pt", "bench-gru-h256.pt")
)

TREELSTM = f"""
[models.treelstm]
builder = "batchmaker.common.models.treelstm:build"
weights = "{{weights}}/bench-treelstm-h256.pt"
vocab_size = 8737
embedding_size = 256
hidden_size = 256
num_classes = 5
batch_sizes = {BATCH_SIZES}
"""


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    model: str  # the served model's name
    model_toml: str  # its [models.NAME] table; {weights} is the weights directory
    dataset: str  # a key of bench.datasets.DATASETS
    policies: tuple[str, ...]
    reference: str  # moderate loads are fractions of this policy's peak throughput
    in_all: bool = True  # run by `all` (presets whose quick run takes minutes are run by name only)


PRESETS = {
    preset.name: preset
    for preset in (
        Preset("lstm", "LSTM on WMT sentence lengths (paper Fig. 7, 9)", "lstm", LSTM, "wmt",
               ("padded", "cellular", "graph"), "padded"),
        Preset("fixed", "LSTM on a fixed length of 24 (paper Fig. 11, top)", "lstm", LSTM, "fixed",
               ("padded", "cellular"), "padded"),
        Preset("longtail", "LSTM on lengths up to 330, shaped like WMT-15 (paper Fig. 10, 11)", "lstm", LSTM,
               "longtail", ("padded", "cellular"), "padded"),
        Preset("seq2seq", "Seq2Seq on WMT sentences, decoding to EOS (paper Fig. 13)", "seq2seq", SEQ2SEQ, "wmt",
               ("padded", "cellular"), "padded"),
        Preset("attention", "Seq2Seq with Luong attention on WMT sentences, decoding to EOS", "seq2seq",
               SEQ2SEQ_ATTENTION, "wmt", ("padded", "cellular"), "padded", in_all=False),
        Preset("tagger", "BiLSTM tagger, 9 tags for every token, on WMT sentence lengths", "tagger", TAGGER, "wmt",
               ("padded", "cellular"), "padded", in_all=False),
        Preset("treelstm", "TreeLSTM on SST trees (paper Fig. 14)", "treelstm", TREELSTM, "sst",
               ("graph", "cellular"), "graph"),
        Preset("tree16", "TreeLSTM on identical complete binary trees of 16 leaves (paper Fig. 15)", "treelstm",
               TREELSTM, "tree16", ("graph", "cellular"), "graph"),
    )
}


def presets_named(name: str) -> list[str]:
    """The presets `./scripts/bench NAME` runs: that one, or for `all` every preset marked `in_all`."""
    return [key for key, preset in PRESETS.items() if preset.in_all] if name == "all" else [name]


@dataclass(frozen=True)
class Sweep:
    """Offered loads as fractions of the raw kernel's ideal request rate, and seconds per load."""

    fractions: tuple[float, ...]
    seconds: float
    saturated_points: int  # stop a policy's sweep after this many loads beyond its capacity
    verify_requests: int  # replies checked against the reference model, per policy
    # The moderate loads on a freshly started server, not on the one the sweep drove past saturation
    # (a smoke run measures them on the same one: it checks that they are served, not how well).
    fresh_server_for_moderate: bool = True
    kernel_twice: bool = True  # the raw kernel measured again after the sweeps, the faster run kept


FULL = Sweep((0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2), seconds=10.0, saturated_points=2,
             verify_requests=60)
# a smoke run: every policy served and checked
QUICK = Sweep((0.1, 0.5), seconds=1.5, saturated_points=1, verify_requests=12,
              fresh_server_for_moderate=False, kernel_twice=False)
