"""The cells of the Seq2Seq model (torch): the planner is common/models/seq2seq.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from batchmaker.common.models.base import Model, token_ids
from batchmaker.common.models.kernels import LSTMKernel, Projection, lstm_input, row_argmax, stored, table_bytes
from batchmaker.common.models.seq2seq import Seq2SeqPlanner

LSTM_KEYS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
DECODER_GAIN = 4.0
EOS_BIAS = 0.2


class TokenStep(nn.Module):
    """A first layer's plain cell: the token's embedding, then an LSTM step."""

    def __init__(self, embedding: nn.Embedding, lstm: nn.LSTMCell):
        super().__init__()
        self.embedding = embedding
        self.lstm = lstm

    def forward(self, tokens: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lstm(self.embedding(tokens), (h, c))


class VectorStep(nn.Module):
    """A higher layer's plain cell: an LSTM step on the h of the layer below."""

    def __init__(self, lstm: nn.LSTMCell):
        super().__init__()
        self.lstm = lstm

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lstm(x, (h, c))


class LuongAttention(nn.Module):
    """Global attention with the "general" score over ragged encoder outputs.

    Each batch row's encoder outputs come as flat rows `memory` with `row_of[k]`, the batch row
    that memory row k belongs to, so requests with different source lengths share one batch: the
    softmax runs per segment (its maximum subtracted first), and a row without memory (a batch's
    padding) gets a zero context."""

    def __init__(self, attention: torch.Tensor, combine: torch.Tensor):
        super().__init__()
        hidden = attention.shape[0]
        self.register_buffer("attention_t", stored(attention.T))
        self.register_buffer("context_t", stored(combine[:, :hidden].T))
        self.register_buffer("state_t", stored(combine[:, hidden:].T))

    def forward(self, h: torch.Tensor, memory: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
        query = torch.mm(h, self.attention_t).index_select(0, row_of)  # W_a h_t, per memory row
        scores = (memory * query).sum(dim=1)
        peak = scores.new_full((h.shape[0],), -torch.inf).scatter_reduce_(0, row_of, scores, "amax")
        weights = torch.exp(scores - peak.index_select(0, row_of))
        total = scores.new_zeros(h.shape[0]).index_add_(0, row_of, weights)
        weights = weights / total.index_select(0, row_of)
        context = h.new_zeros(h.shape).index_add_(0, row_of, memory * weights.unsqueeze(1))
        return torch.tanh(torch.addmm(torch.mm(context, self.context_t), h, self.state_t))


class DecoderCell(nn.Module):
    """The top decoder layer: an LSTM step (`step`: a TokenStep or VectorStep, or their kernels),
    then attention over the encoder outputs when given, the projection and the argmax."""

    def __init__(self, step: nn.Module, projection: nn.Module, attention: LuongAttention | None = None):
        super().__init__()
        self.step = step
        self.projection = projection
        self.attention = attention

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, *memory: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        h, c = self.step(x, h, c)
        attended = h if self.attention is None else self.attention(h, *memory)
        return h, c, row_argmax(self.projection(attended))


class Seq2SeqModel(Seq2SeqPlanner, Model):
    """The encoder and decoder cells, their weights and the greedy-decoding reference."""

    def _lstm_weights(self, state: dict[str, torch.Tensor], part: str, layer: int) -> dict[str, torch.Tensor]:
        return {k: state[f"{part}.lstm.{k}_l{layer}"] for k in LSTM_KEYS}

    def _attention(self, state: dict[str, torch.Tensor]) -> LuongAttention | None:
        if self.attention is None:
            return None
        return LuongAttention(state["decoder.attention.weight"], state["decoder.combine.weight"])

    def _cells(
        self, state: dict[str, torch.Tensor], steps: dict[str, list[nn.Module]], projection: nn.Module
    ) -> dict[str, nn.Module]:
        """Cells by key from each part's layer steps: the top decoder layer wrapped to project."""
        keys = {"encoder": self.encoder_keys, "decoder": self.decoder_keys}
        cells = {key: step for part, layers in steps.items() for key, step in zip(keys[part], layers, strict=True)}
        cells[self.decoder_key] = DecoderCell(cells[self.decoder_key], projection, self._attention(state))
        return cells

    def make_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        fold = self.folds(table_bytes(self.src_vocab_size + self.tgt_vocab_size, 4 * self.hidden_size))

        def step(part: str, layer: int) -> LSTMKernel:
            w = self._lstm_weights(state, part, layer)
            embedding = state[f"{part}.embedding.weight"] if layer == 0 else None
            return LSTMKernel(lstm_input(embedding, w["weight_ih"], w["bias_ih"], w["bias_hh"], fold), w["weight_hh"])

        steps = {part: [step(part, layer) for layer in range(self.num_layers)] for part in ("encoder", "decoder")}
        return self._cells(
            state, steps, Projection(state["decoder.projection.weight"], state["decoder.projection.bias"])
        )

    def torch_nn_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        steps: dict[str, list[nn.Module]] = {}
        for part, vocab_size in (("encoder", self.src_vocab_size), ("decoder", self.tgt_vocab_size)):
            embedding = nn.Embedding(vocab_size, self.embedding_size)
            embedding.load_state_dict({"weight": state[f"{part}.embedding.weight"]})
            steps[part] = []
            for layer in range(self.num_layers):
                lstm = nn.LSTMCell(self.embedding_size if layer == 0 else self.hidden_size, self.hidden_size)
                lstm.load_state_dict(self._lstm_weights(state, part, layer))
                steps[part].append(TokenStep(embedding, lstm) if layer == 0 else VectorStep(lstm))
        return self._cells(state, steps, self._projection(state))

    def _projection(self, state: dict[str, torch.Tensor]) -> nn.Linear:
        projection = nn.Linear(self.hidden_size, self.tgt_vocab_size)
        projection.load_state_dict(
            {"weight": state["decoder.projection.weight"], "bias": state["decoder.projection.bias"]}
        )
        return projection

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        rows, emb, hidden = 4 * self.hidden_size, self.embedding_size, self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {
            "encoder.embedding.weight": (self.src_vocab_size, emb),
            "decoder.embedding.weight": (self.tgt_vocab_size, emb),
            "decoder.projection.weight": (self.tgt_vocab_size, hidden),
            "decoder.projection.bias": (self.tgt_vocab_size,),
        }
        for part in ("encoder", "decoder"):
            for layer in range(self.num_layers):
                shapes[f"{part}.lstm.weight_ih_l{layer}"] = (rows, emb if layer == 0 else hidden)
                shapes[f"{part}.lstm.weight_hh_l{layer}"] = (rows, hidden)
                shapes[f"{part}.lstm.bias_ih_l{layer}"] = (rows,)
                shapes[f"{part}.lstm.bias_hh_l{layer}"] = (rows,)
        if self.attention is not None:
            shapes["decoder.attention.weight"] = (hidden, hidden)
            shapes["decoder.combine.weight"] = (hidden, 2 * hidden)
        return shapes

    def init_weights(self, seed: int) -> dict[str, torch.Tensor]:
        """Random weights that decode like a trained model: outputs of varied length ending in EOS.

        Plain random weights make greedy decoding settle on one repeated token that is
        never EOS; a livelier decoder (recurrent and projection weights scaled up) and a
        small EOS bias make decoding stop at lengths that vary with the source.
        """
        generator = torch.Generator().manual_seed(seed)
        bound = self.hidden_size**-0.5
        state = {}
        for key, shape in self.weight_shapes().items():
            if key.endswith("embedding.weight"):
                state[key] = torch.randn(shape, generator=generator)
            else:
                state[key] = (torch.rand(shape, generator=generator) * 2 - 1) * bound
        state["decoder.lstm.weight_hh_l0"] *= DECODER_GAIN
        state["decoder.projection.weight"] *= DECODER_GAIN
        state["decoder.projection.bias"][self.eos_id] += EOS_BIAS
        return state

    def reference(self, state: dict[str, torch.Tensor], inputs: Any) -> dict[str, Any]:
        """Greedy decoding one request at a time: torch.nn.LSTM over the source, then a step loop of
        torch.nn.LSTM steps (all layers) with attention written out in torch.

        Besides `tokens`, returns `margins`: each step's gap between the two largest logits,
        so a comparison can tell a real difference from a float near-tie of the argmax.
        """
        return self.reference_forward(state)(inputs)

    def reference_forward(self, state: dict[str, torch.Tensor]) -> Callable[[Any], dict[str, Any]]:
        embeddings, lstms = {}, {}
        for part, vocab_size in (("encoder", self.src_vocab_size), ("decoder", self.tgt_vocab_size)):
            embeddings[part] = nn.Embedding(vocab_size, self.embedding_size)
            embeddings[part].load_state_dict({"weight": state[f"{part}.embedding.weight"]})
            lstms[part] = nn.LSTM(self.embedding_size, self.hidden_size, num_layers=self.num_layers)
            prefix = f"{part}.lstm."
            lstms[part].load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
        projection = self._projection(state)

        def forward(inputs: Any) -> dict[str, Any]:
            source = torch.from_numpy(token_ids(inputs, "tokens", self.src_vocab_size, self.max_length))
            max_len = self._max_len(inputs, len(source))
            decoded: list[int] = []
            margins: list[float] = []
            with torch.inference_mode():
                memory, (h, c) = lstms["encoder"](embeddings["encoder"](source))
                token = self.go_id
                while len(decoded) < max_len:
                    output, (h, c) = lstms["decoder"](embeddings["decoder"](torch.tensor([token])), (h, c))
                    top = output[0]
                    if self.attention is not None:
                        weights = torch.softmax(memory @ (state["decoder.attention.weight"] @ top), dim=0)
                        top = torch.tanh(state["decoder.combine.weight"] @ torch.cat([weights @ memory, top]))
                    logits = projection(top)
                    best = torch.topk(logits, 2).values
                    margins.append(float(best[0] - best[1]))
                    token = int(logits.argmax())
                    if token == self.eos_id:
                        break
                    decoded.append(token)
            return {"tokens": np.array(decoded, dtype=np.int64), "margins": np.array(margins, dtype=np.float32)}

        return forward
