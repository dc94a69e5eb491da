"""The worked examples of docs/models.md, trained for seconds and served: the server answers what the trained
torch modules compute."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import RunningServer, start_server, stop_server, wait_idle, write_config

from batchmaker.clients import AsyncClient
from batchmaker.clients.text import Vocabulary
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model
from batchmaker.common.models.base import save_weights
from examples.forecaster import forecast, stream
from examples.forecaster import train as forecaster_example
from examples.forecaster.train import Forecaster
from examples.tagger import tag
from examples.tagger import train as tagger_example

TOLERANCE = 1e-5


def example_models(config: Path, name: str) -> str:
    """The example config's [models.NAME] table (its weights path is relative, so it names a file beside the copy)."""
    text = config.read_text()
    return text[text.index(f"[models.{name}]"):]


def test_the_tagging_rule_marks_runs_of_capitalized_words_after_the_first():
    words = ["It", "is", "the", "Italian", "Federation", "of", "Aerobic", "Fitness", ",", "said", "I"]
    assert [tagger_example.TAGS[t] for t in tagger_example.tag_words(words)] == list("OOOBIOBIOOB")


@pytest.mark.parametrize("example", [tagger_example, forecaster_example], ids=["tagger", "forecaster"])
def test_a_training_script_writes_the_weights_its_config_serves(example, tmp_path: Path, capsys):
    config = tmp_path / example.CONFIG.name
    config.write_text(example.CONFIG.read_text())
    example.main(["--config", str(config), "--steps", "2"])
    (model_config,) = load_config(config).models.values()
    assert f"wrote {model_config.weights}" in capsys.readouterr().out
    build_model(model_config).load_weights()  # every key the server reads, with its shape


def test_the_served_tagger_returns_the_trained_modules_logits_for_every_token(tmp_path: Path):
    example = load_config(tagger_example.CONFIG).models["tagger"]
    tagger, loss = tagger_example.train(example, steps=40, seed=0)
    assert np.isfinite(loss)
    save_weights(tagger.state_dict(), tmp_path / "tagger.pt")
    config = write_config(tmp_path, example_models(tagger_example.CONFIG, "tagger"))
    held_out = tagger_example.tagged_sentences(Vocabulary())[-tagger_example.HELD_OUT:]
    server = start_server(config, workers=1)
    try:

        async def send() -> list:
            async with AsyncClient(server.address, timeout=120) as client:
                return await asyncio.gather(*(client.infer("tagger", {"tokens": tokens.tolist()})
                                              for tokens, _ in held_out))

        replies = asyncio.run(send())  # mixed lengths, batched together
        with torch.inference_mode():
            expected = tagger([tokens for tokens, _ in held_out])
        for (tokens, _), reply, logits in zip(held_out, replies, expected):
            assert reply.outputs["logits"].shape == (len(tokens), 3)
            assert np.abs(reply.outputs["logits"] - logits.numpy()).max() <= TOLERANCE
        sentence = "The delegation of the European Parliament met in Strasbourg ."
        with server.client() as client:
            tagged = tag.tag(client, Vocabulary(), sentence)
        with torch.inference_mode():
            (offline,) = tagger([torch.tensor(Vocabulary().encode(sentence))])
        assert [label for _, label in tagged] == [tagger_example.TAGS[int(i)] for i in offline.argmax(-1)]
        assert [word for word, _ in tagged] == sentence.split()
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def served_forecaster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Forecaster]]:
    """The example forecaster trained for 40 steps and served by one worker."""
    directory = tmp_path_factory.mktemp("forecaster")
    example = load_config(forecaster_example.CONFIG).models["forecaster"]
    forecaster, loss = forecaster_example.train(example, steps=40, seed=0)
    assert np.isfinite(loss)
    save_weights(forecaster.state_dict(), directory / "forecaster.pt")
    server = start_server(write_config(directory, example_models(forecaster_example.CONFIG, "forecaster")), workers=1)
    yield server, forecaster
    stop_server(server)


def test_the_served_forecaster_returns_the_trained_modules_forecast_for_float_inputs(served_forecaster):
    server, forecaster = served_forecaster
    rng = np.random.default_rng(3)
    windows = [forecaster_example.sensor_series(rng, int(n))[0] for n in rng.integers(1, 200, size=60)]

    async def send() -> list:
        async with AsyncClient(server.address, timeout=120) as client:
            return await asyncio.gather(*(client.infer("forecaster", {"x": x}) for x in windows))

    replies = asyncio.run(send())  # mixed lengths, batched together
    with torch.inference_mode():
        expected = forecaster([torch.from_numpy(x) for x in windows]).numpy()
        finals = [forecaster.gru(torch.from_numpy(x))[1].numpy() for x in windows]
    for reply, logits, h_n in zip(replies, expected, finals):
        assert np.abs(reply.outputs["logits"] - logits).max() <= TOLERANCE
        assert np.abs(reply.outputs["h_n"] - h_n).max() <= TOLERANCE
    with server.client() as client:
        alone = forecast.forecast(client, windows[0].astype(np.float64))  # the client sends float32
    assert np.abs(alone - expected[0]).max() <= TOLERANCE



def test_a_series_sent_in_chunks_of_a_session_forecasts_as_the_whole_series(served_forecaster, capsys):
    server, forecaster = served_forecaster
    readings, _ = forecaster_example.sensor_series(np.random.default_rng(5), 301)
    with server.client() as client:
        replies = stream.forecast_in_chunks(client, readings, chunk=37, session="sensor-1")
        assert [reply.session_step for reply in replies] == list(range(1, 10))
        assert wait_idle(client)["sessions"] == 0  # session_end on the last chunk freed it
    with torch.inference_mode():
        (whole,) = forecaster([torch.from_numpy(readings)]).numpy()
    assert np.abs(replies[-1].outputs["logits"] - whole).max() <= TOLERANCE
    assert stream.main(["--address", server.address, "--length", "200", "--chunk", "30"]) == 0
    assert "chunked and whole-series forecasts agree" in capsys.readouterr().out
