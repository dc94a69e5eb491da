"""Serving kernels of the built-in cells: torch.nn's arithmetic, rearranged so a batch costs less.

Three rearrangements, each exact up to float32 rounding (docs/models.md, "Cell kernels"):

* **Folded input projections.** When a cell's input is a token, its input projection
  `embedding @ W_ih^T + b_ih` takes one of `vocab_size` values, so it is computed once at
  load time as a table (in float64, rounded once); a step gathers a row instead of
  multiplying a matrix, which halves the work of an LSTM step when the embedding is as wide
  as the state.
* **One sigmoid over all gates.** tanh(x) = 2σ(2x) - 1, and σ runs several times faster
  than tanh on the CPU. The rows of tanh gates are doubled at load time (an exact scaling),
  so one sigmoid over the whole gate matrix yields every gate.
* **Accumulation in place.** Biases enter as the `addmm` accumulator, the recurrent product
  is added into the projected input, and transposed weights are stored contiguous.
"""

from __future__ import annotations

import torch
from torch import nn


def table_bytes(vocab_size: int, rows: int) -> int:
    """Memory of a folded table of `rows`-wide float32 projections of every token."""
    return vocab_size * rows * 4


def stored(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a weight for a kernel to keep: no buffer aliases the weights file's tensors."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def doubled(matrix: torch.Tensor, gates: int, tanh_gates: tuple[int, ...]) -> torch.Tensor:
    """A copy of a stacked gate weight (or bias) with the rows of its tanh gates times two."""
    scaled = stored(matrix)
    blocks = scaled.view(gates, -1, *scaled.shape[1:])
    for gate in tanh_gates:
        blocks.select(0, gate).mul_(2)
    return scaled


def tanh_of_half(s: torch.Tensor) -> torch.Tensor:
    """tanh(x) from s = σ(2x), in place."""
    return s.mul_(2).sub_(1)


def fast_tanh(x: torch.Tensor) -> torch.Tensor:
    return tanh_of_half(torch.sigmoid(x * 2))


class TokenTable(nn.Module):
    """Folded input projection: one precomputed row per token."""

    def __init__(self, embedding: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        table = torch.addmm(bias.double(), embedding.double(), weight.double().T)
        self.register_buffer("table", table.float())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.index_select(0, tokens)


class EmbeddedProjection(nn.Module):
    """Input projection of a token computed per step: the embedding row times W_ih^T plus b_ih."""

    def __init__(self, embedding: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.register_buffer("embedding", stored(embedding))
        self.register_buffer("weight_t", stored(weight.T))
        self.register_buffer("bias", stored(bias))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, self.embedding.index_select(0, tokens), self.weight_t)


class Projection(nn.Module):
    """Input projection of a vector: x W^T + b."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.register_buffer("weight_t", stored(weight.T))
        self.register_buffer("bias", stored(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight_t)


class PairProjection(nn.Module):
    """Input projection of two vectors side by side, [a, b] W^T + b, without concatenating them:
    W's columns split at `split` (a bidirectional layer reading both directions of the one below)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, split: int):
        super().__init__()
        self.register_buffer("first_t", stored(weight[:, :split].T))
        self.register_buffer("second_t", stored(weight[:, split:].T))
        self.register_buffer("bias", stored(bias))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, a, self.first_t).addmm_(b, self.second_t)


def vector_projection(weight: torch.Tensor, bias: torch.Tensor, split: int | None = None) -> nn.Module:
    """The input projection of one vector, or of two side by side when `split` is given."""
    return Projection(weight, bias) if split is None else PairProjection(weight, bias, split)


def token_projection(embedding: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, fold: bool) -> nn.Module:
    """The input projection of a cell whose input is a token: folded into a table, or per step."""
    return TokenTable(embedding, weight, bias) if fold else EmbeddedProjection(embedding, weight, bias)


LSTM_GATES = 4  # i, f, g, o: torch.nn.LSTM's row order
LSTM_TANH = (2,)
GRU_GATES = 3  # r, z, n: torch.nn.GRU's row order
GRU_TANH = (2,)


def lstm_input(
    embedding: torch.Tensor | None,
    weight_ih: torch.Tensor,
    bias_ih: torch.Tensor,
    bias_hh: torch.Tensor,
    fold: bool,
    split: int | None = None,
) -> nn.Module:
    """An LSTM layer's input projection with both biases and the g rows doubled: of a token when
    `embedding` is given (a table when `fold`), of a vector (or two, split at `split`) otherwise."""
    weight = doubled(weight_ih, LSTM_GATES, LSTM_TANH)
    bias = doubled(bias_ih + bias_hh, LSTM_GATES, LSTM_TANH)
    return (
        vector_projection(weight, bias, split) if embedding is None else token_projection(embedding, weight, bias, fold)
    )


def lstm_update(gates: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, c) from an LSTM step's pre-activations (g rows doubled) and the previous c."""
    i, f, g, o = torch.sigmoid(gates).chunk(4, dim=1)
    c = torch.addcmul(f * c, i, g, value=2).sub_(i)  # f c + i (2σ(2g) - 1)
    return fast_tanh(c).mul_(o), c


class LSTMKernel(nn.Module):
    """(x, h, c) -> (h, c), where x is whatever `projection` takes: a token or the layer below's h."""

    def __init__(self, projection: nn.Module, weight_hh: torch.Tensor):
        super().__init__()
        self.projection = projection
        self.register_buffer("recurrent_t", stored(doubled(weight_hh, LSTM_GATES, LSTM_TANH).T))

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return lstm_update(self.projection(x).addmm_(h, self.recurrent_t), c)


class PairLSTMKernel(LSTMKernel):
    """(x_forward, x_reverse, h, c) -> (h, c): a layer above a bidirectional one (a PairProjection)."""

    def forward(
        self, a: torch.Tensor, b: torch.Tensor, h: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return lstm_update(self.projection(a, b).addmm_(h, self.recurrent_t), c)


def gru_input(
    embedding: torch.Tensor | None, weight_ih: torch.Tensor, bias_ih: torch.Tensor, fold: bool, split: int | None = None
) -> nn.Module:
    """A GRU layer's input projection with b_ih and the n rows doubled (b_hh stays with h: r scales it)."""
    weight = doubled(weight_ih, GRU_GATES, GRU_TANH)
    bias = doubled(bias_ih, GRU_GATES, GRU_TANH)
    return (
        vector_projection(weight, bias, split) if embedding is None else token_projection(embedding, weight, bias, fold)
    )


class GRUKernel(nn.Module):
    """(x, h) -> (h,): n = tanh(x_n + r (W_hn h + b_hn)), h' = n + z (h - n)."""

    def __init__(self, projection: nn.Module, weight_hh: torch.Tensor, bias_hh: torch.Tensor):
        super().__init__()
        self.projection = projection
        self.recurrent = Projection(doubled(weight_hh, GRU_GATES, GRU_TANH), doubled(bias_hh, GRU_GATES, GRU_TANH))

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor]:
        return self.update(self.projection(x), h)

    def update(self, projected: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor]:
        recurrent = self.recurrent(h)
        both = 2 * h.shape[1]
        r, z = torch.sigmoid(projected[:, :both].add_(recurrent[:, :both])).chunk(2, dim=1)
        n = tanh_of_half(torch.sigmoid(torch.addcmul(projected[:, both:], r, recurrent[:, both:])))
        return (torch.addcmul(n, z, h - n),)


class PairGRUKernel(GRUKernel):
    """(x_forward, x_reverse, h) -> (h,): a layer above a bidirectional one (a PairProjection)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor]:
        return self.update(self.projection(a, b), h)


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest score (the first, at a tie), as int64.

    On the CPU numpy's vectorized argmax is about twenty times faster than torch's at a
    decoder's batch x vocabulary; elsewhere (a GPU, a captured graph) torch's runs on the device."""
    if scores.device.type == "cpu" and not scores.requires_grad:
        return torch.from_numpy(scores.numpy().argmax(axis=1))
    return scores.argmax(dim=1)


def tree_state(
    i: torch.Tensor, o: torch.Tensor, u: torch.Tensor, carried: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The end of a TreeLSTM node from its gates after the sigmoid (u from doubled rows):
    c = i tanh(u) + what the forget gates carried over, h = o tanh(c)."""
    c = torch.addcmul(-i if carried is None else carried - i, i, u, value=2)
    return fast_tanh(c).mul_(o), c
