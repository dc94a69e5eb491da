"""The `model.py` of Triton's Python backend for the bench LSTM behind Triton's sequence batcher
(bench/triton_sequence.py copies this file into the model repository it writes; Triton's backend stub imports
it there, never batchmaker).

Each request is one token of a sequence; the sequence batcher ("oldest" strategy) gathers one step of up to
max_batch_size sequences into one `execute`. The model keeps each sequence's (h, c) by its correlation id from
its start to its end, and runs one step of torch's nn.Embedding + nn.LSTM for the whole batch; every step
answers the state after that token, so the last step's answer is the sentence's. The sequence batcher sends at
most one step of a sequence in a batch.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import triton_python_backend_utils as pb_utils

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
        """One step of every sequence in the batch: a fresh state at its start, forgotten at its end. A step the
        model cannot run is refused alone, and ends its sequence's state."""
        steps = [_step(request) for request in requests]
        refusals = [self._refusal(*step) for step in steps]
        valid = [step for step, refusal in zip(steps, refusals) if refusal is None]
        answers = self._run(valid) if valid else {}
        responses = []
        for (sequence, _, _, _), refusal in zip(steps, refusals):
            if refusal is None:
                responses.append(pb_utils.InferenceResponse(output_tensors=answers[sequence]))
            else:
                self.states.pop(sequence, None)
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(refusal)))
        return responses

    def _refusal(self, sequence: int, token: int, start: bool, _: bool) -> str | None:
        vocabulary = self.embedding.num_embeddings
        if not 0 <= token < vocabulary:
            return f"token {token} is outside the vocabulary (0 to {vocabulary - 1})"
        if not start and sequence not in self.states:
            return f"sequence {sequence} has no state: a step of it was refused"
        return None

    def _run(self, steps: list[tuple[int, int, bool, bool]]) -> dict[int, list[Any]]:
        """One LSTM step of these sequences; each one's outputs by its correlation id."""
        before = [(self.zero, self.zero) if start else self.states[sequence] for sequence, _, start, _ in steps]
        h0 = torch.stack([h for h, _ in before])[None]
        c0 = torch.stack([c for _, c in before])[None]
        with torch.inference_mode():
            embedded = self.embedding(torch.tensor([token for _, token, _, _ in steps]))[:, None]
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


def _step(request: Any) -> tuple[int, int, bool, bool]:
    """The request's correlation id, its token, whether it starts its sequence and whether it ends it."""
    sequence, token, start, end = (
        int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])
        for name in ("CORRID", "tokens", "START", "END")
    )
    return sequence, token, bool(start), bool(end)
