"""The cells of the Seq2Seq model (torch): the planner is common/models/seq2seq.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from common.models.base import Model, token_ids
from common.models.kernels import LSTMKernel, Projection, lstm_input, row_argmax, table_bytes
from common.models.seq2seq import Seq2SeqPlanner

LSTM_KEYS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
DECODER_GAIN = 4.0
EOS_BIAS = 0.2


class EncoderCell(nn.Module):
    def __init__(self, embedding: nn.Embedding, lstm: nn.LSTMCell):
        super().__init__()
        self.embedding = embedding
        self.lstm = lstm

    def forward(self, tokens: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lstm(self.embedding(tokens), (h, c))


class DecoderCell(nn.Module):
    def __init__(self, embedding: nn.Embedding, lstm: nn.LSTMCell, projection: nn.Linear):
        super().__init__()
        self.embedding = embedding
        self.lstm = lstm
        self.projection = projection

    def forward(self, tokens: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h, c = self.lstm(self.embedding(tokens), (h, c))
        return h, c, self.projection(h).argmax(dim=1)


class DecoderKernel(nn.Module):
    """The decoder's serving kernel: an LSTM step, then the argmax of the vocabulary projection."""

    def __init__(self, step: LSTMKernel, projection: Projection):
        super().__init__()
        self.step = step
        self.projection = projection

    def forward(self, tokens: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h, c = self.step(tokens, h, c)
        return h, c, row_argmax(self.projection(h))


class Seq2SeqModel(Seq2SeqPlanner, Model):
    """The encoder and decoder cells, their weights and the greedy-decoding reference."""

    def _modules(self, state: dict[str, torch.Tensor]) -> tuple[nn.Module, ...]:
        src_embedding = nn.Embedding(self.src_vocab_size, self.embedding_size)
        tgt_embedding = nn.Embedding(self.tgt_vocab_size, self.embedding_size)
        src_embedding.load_state_dict({"weight": state["encoder.embedding.weight"]})
        tgt_embedding.load_state_dict({"weight": state["decoder.embedding.weight"]})
        encoder, decoder = nn.LSTMCell(self.embedding_size, self.hidden_size), nn.LSTMCell(self.embedding_size, self.hidden_size)
        encoder.load_state_dict({k: state[f"encoder.lstm.{k}_l0"] for k in LSTM_KEYS})
        decoder.load_state_dict({k: state[f"decoder.lstm.{k}_l0"] for k in LSTM_KEYS})
        projection = nn.Linear(self.hidden_size, self.tgt_vocab_size)
        projection.load_state_dict({"weight": state["decoder.projection.weight"], "bias": state["decoder.projection.bias"]})
        return src_embedding, encoder, tgt_embedding, decoder, projection

    def make_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        fold = self.folds(table_bytes(self.src_vocab_size + self.tgt_vocab_size, 4 * self.hidden_size))

        def step(part: str) -> LSTMKernel:
            w = {k: state[f"{part}.lstm.{k}_l0"] for k in LSTM_KEYS}
            embedding = state[f"{part}.embedding.weight"]
            return LSTMKernel(lstm_input(embedding, w["weight_ih"], w["bias_ih"], w["bias_hh"], fold), w["weight_hh"])

        vocabulary = Projection(state["decoder.projection.weight"], state["decoder.projection.bias"])
        return {self.encoder_key: step("encoder"), self.decoder_key: DecoderKernel(step("decoder"), vocabulary)}

    def torch_nn_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        src_embedding, encoder, tgt_embedding, decoder, projection = self._modules(state)
        return {
            self.encoder_key: EncoderCell(src_embedding, encoder),
            self.decoder_key: DecoderCell(tgt_embedding, decoder, projection),
        }

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        rows, emb, hidden = 4 * self.hidden_size, self.embedding_size, self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {
            "encoder.embedding.weight": (self.src_vocab_size, emb),
            "decoder.embedding.weight": (self.tgt_vocab_size, emb),
            "decoder.projection.weight": (self.tgt_vocab_size, hidden),
            "decoder.projection.bias": (self.tgt_vocab_size,),
        }
        for part in ("encoder", "decoder"):
            shapes[f"{part}.lstm.weight_ih_l0"] = (rows, emb)
            shapes[f"{part}.lstm.weight_hh_l0"] = (rows, hidden)
            shapes[f"{part}.lstm.bias_ih_l0"] = (rows,)
            shapes[f"{part}.lstm.bias_hh_l0"] = (rows,)
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
        """Greedy decoding one request at a time: torch.nn.LSTM over the source, then a step loop.

        Besides `tokens`, returns `margins`: each step's gap between the two largest logits,
        so a comparison can tell a real difference from a float near-tie of the argmax.
        """
        source = torch.from_numpy(token_ids(inputs, "tokens", self.src_vocab_size, self.max_length))
        max_len = self._max_len(inputs, len(source))
        src_embedding, _, tgt_embedding, decoder, projection = self._modules(state)
        encoder = nn.LSTM(self.embedding_size, self.hidden_size)
        encoder.load_state_dict({f"{k}_l0": state[f"encoder.lstm.{k}_l0"] for k in LSTM_KEYS})
        decoded: list[int] = []
        margins: list[float] = []
        with torch.inference_mode():
            _, (h, c) = encoder(src_embedding(source))
            h, c = h[0], c[0]
            token = self.go_id
            while len(decoded) < max_len:
                h, c = decoder(tgt_embedding(torch.tensor(token)), (h, c))
                logits = projection(h)
                top = torch.topk(logits, 2).values
                margins.append(float(top[0] - top[1]))
                token = int(logits.argmax())
                if token == self.eos_id:
                    break
                decoded.append(token)
        return {"tokens": np.array(decoded, dtype=np.int64), "margins": np.array(margins, dtype=np.float32)}
