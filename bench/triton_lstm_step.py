"""The `model.py` of Triton's Python backend for the bench LSTM behind Triton's sequence batcher
(bench/triton_sequence.py copies this file into the model repository it writes; Triton's backend stub imports
it there, never batchmaker).

Each request carries the next few tokens of a sequence; the sequence batcher gathers the next request of up to
max_batch_size sequences into one `execute`, and sends every request of a sequence to the same model instance.
The instance keeps each sequence's (h, c) by its correlation id from its start to its end, and runs torch's
nn.Embedding + nn.LSTM over the batch's tokens from those states (packed, where requests carry different numbers
of tokens); every request answers the state after its last token, so a sentence's last request answers the
sentence. The sequence batcher sends at most one request of a sequence in a batch; the `direct` strategy's null
requests (READY false, standing in for a batch slot without a request) are answered without running.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.nn.utils.rnn import pack_padded_sequence

from batchmaker.common.config import load_config
from batchmaker.common.models import build_model


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        """Load the weights of the batchmaker config's lstm, named by the model configuration's parameters."""
        parameters = json.loads(args["model_config"])["parameters"]
        torch.set_num_threads(1)  # as a batchmaker CPU worker in the benchmarks (threads_per_worker = 1)
        model = build_model(load_config(parameters["config"]["string_value"]).models["lstm"])
        self.embedding = torch.nn.Embedding(model.vocab_size, model.embedding_size)
        self.lstm = torch.nn.LSTM(model.embedding_size, model.hidden_size, batch_first=True)
        module = torch.nn.Module()
        module.embedding, module.lstm = self.embedding, self.lstm
        module.load_state_dict(model.load_weights())  # the state_dict names batchmaker's chain LSTM serves
        self.zero = torch.zeros(model.hidden_size)
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by correlation id, while it runs

    def execute(self, requests: list[Any]) -> list[Any]:
        """The next tokens of every sequence in the batch: a fresh state at its start, forgotten at its end. A
        request the model cannot run is refused alone, and ends its sequence's state."""
        steps = [_step(request) if _ready(request) else None for request in requests]
        refusals = [None if step is None else self._refusal(*step) for step in steps]
        valid = [step for step, refusal in zip(steps, refusals) if step is not None and refusal is None]
        answers = self._run(valid) if valid else {}
        responses = []
        for step, refusal in zip(steps, refusals):
            if step is None:  # a null request: its answer goes nowhere
                responses.append(pb_utils.InferenceResponse(output_tensors=[]))
                continue
            sequence = step[0]
            if refusal is None:
                responses.append(pb_utils.InferenceResponse(output_tensors=answers[sequence]))
            else:
                self.states.pop(sequence, None)
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(refusal)))
        return responses

    def _refusal(self, sequence: int, tokens: np.ndarray, start: bool, _: bool) -> str | None:
        vocabulary = self.embedding.num_embeddings
        if not len(tokens):
            return "a request of a sequence needs at least one token"
        outside = tokens[(tokens < 0) | (tokens >= vocabulary)]
        if len(outside):
            return f"token {outside[0]} is outside the vocabulary (0 to {vocabulary - 1})"
        if not start and sequence not in self.states:
            return f"sequence {sequence} has no state: a request of it was refused"
        return None

    def _run(self, steps: list[tuple[int, np.ndarray, bool, bool]]) -> dict[int, list[Any]]:
        """These sequences' next tokens, from their states; each one's outputs by its correlation id."""
        before = [(self.zero, self.zero) if start else self.states[sequence] for sequence, _, start, _ in steps]
        h0 = torch.stack([h for h, _ in before])[None]
        c0 = torch.stack([c for _, c in before])[None]
        lengths = [len(tokens) for _, tokens, _, _ in steps]
        padded = np.zeros((len(steps), max(lengths)), dtype=np.int64)
        for row, (_, tokens, _, _) in enumerate(steps):
            padded[row, : len(tokens)] = tokens
        with torch.inference_mode():
            embedded = self.embedding(torch.from_numpy(padded))
            if min(lengths) < max(lengths):  # the LSTM stops each row at its own last token
                embedded = pack_padded_sequence(embedded, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
            _, (h, c) = self.lstm(embedded, (h0, c0))
        answers = {}
        for row, (sequence, _, _, end) in enumerate(steps):
            if end:
                self.states.pop(sequence, None)
            else:
                self.states[sequence] = (h[0, row], c[0, row])
            answers[sequence] = [
                pb_utils.Tensor(name, state[0, row : row + 1].numpy()) for name, state in (("h", h), ("c", c))
            ]
        return answers


def _ready(request: Any) -> bool:
    """False for the direct strategy's null requests."""
    return bool(pb_utils.get_input_tensor_by_name(request, "READY").as_numpy().reshape(-1)[0])


def _step(request: Any) -> tuple[int, np.ndarray, bool, bool]:
    """The request's correlation id, its tokens, whether it starts its sequence and whether it ends it."""
    sequence, start, end = (
        int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])
        for name in ("CORRID", "START", "END")
    )
    tokens = pb_utils.get_input_tensor_by_name(request, "tokens").as_numpy().reshape(-1)
    return sequence, tokens, bool(start), bool(end)
