"""Client library tests that need no real server: tokenizer, data bundle, and clients against a fake ROUTER."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from batchmaker.clients import AsyncClient, Client, ServerError
from batchmaker.clients.cli import main as cli_main
from batchmaker.clients.text import DEFAULT_SENTENCES, DEFAULT_VOCAB, RESERVED, UNK, Vocabulary, load_sentences
from batchmaker.common.protocol import (
    UNKNOWN_MODEL,
    decode,
    encode,
    error_reply,
    is_tensor_map,
    map_to_tensor,
    tensor_to_map,
)

ROOT = Path(__file__).resolve().parents[1]
SHARED_SOURCE = ROOT.parent / "shared" / "data" / "wmt16-ende"


# -- tokenizer and data bundle ------------------------------------------------------------------


def test_vocabulary_has_8192_tokens_and_reserved_ids() -> None:
    vocab = Vocabulary(DEFAULT_VOCAB)
    assert len(vocab) == 8192
    assert tuple(vocab.tokens[:4]) == RESERVED == ("<pad>", "<unk>", "<s>", "</s>")
    assert [vocab.ids[token] for token in RESERVED] == [0, 1, 2, 3]


def test_encode_known_unknown_and_case() -> None:
    vocab = Vocabulary()
    the = vocab.ids["the"]
    assert the >= 4
    assert vocab.encode("the") == [the]
    assert vocab.encode("The") == [the]
    assert vocab.encode("zzqxv-not-a-word") == [UNK] == [1]
    assert vocab.encode("  The\tParliament \n") == vocab.encode("the parliament")
    assert len(vocab.encode("the parliament")) == 2


def test_vocabulary_refuses_a_file_without_reserved_tokens(tmp_path: Path) -> None:
    path = tmp_path / "vocab.txt"
    path.write_text("the\n<pad>\n<unk>\n<s>\n</s>\n", encoding="utf-8")
    with pytest.raises(ValueError, match="reserved"):
        Vocabulary(path)


def test_sample_has_2000_unescaped_lines() -> None:
    lines = DEFAULT_SENTENCES.read_text(encoding="utf-8").removesuffix("\n").split("\n")
    assert len(lines) == 2000
    text = "\n".join(lines)
    assert "&apos;" not in text and "&quot;" not in text
    assert "'" in text
    sentences = load_sentences(DEFAULT_SENTENCES)
    assert sentences and all(sentence.strip() for sentence in sentences)


@pytest.mark.skipif(not (SHARED_SOURCE / "train.en").exists(), reason="shared WMT16 sample not available")
def test_bundle_is_reproducible(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_text_sample", ROOT / "scripts" / "make_text_sample.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--source", str(SHARED_SOURCE), "--out", str(tmp_path)]) == 0
    for name in ("sample.en", "vocab.en"):
        assert (tmp_path / name).read_bytes() == (DEFAULT_VOCAB.parent / name).read_bytes()


def test_clients_import_neither_torch_nor_the_server() -> None:
    code = (
        "import sys, batchmaker.clients, batchmaker.clients.cli, batchmaker.clients.text\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or "
        "m.startswith(('batchmaker.manager', 'batchmaker.worker'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_server_error_carries_code_message_and_id() -> None:
    error = ServerError("OVERLOADED", "too many requests", 7)
    assert (error.code, error.message, error.request_id) == ("OVERLOADED", "too many requests", 7)
    assert "OVERLOADED" in str(error) and "too many requests" in str(error)
    assert isinstance(error, Exception)


# -- clients against nothing and against a fake server --------------------------------------------


def test_sync_client_times_out_when_nothing_listens(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/nobody.ipc"
    start = time.monotonic()
    with Client(address, timeout=0.3) as client, pytest.raises(TimeoutError, match=address):
        client.health()
    assert time.monotonic() - start < 30  # it gave up rather than hanging (0.3 s asked; margin for busy machines)


class FakeServer:
    """A ROUTER thread answering like the manager (docs/protocol.md).

    Replies are sent in reverse order once `batch` requests have arrived; requests
    for model "hold" are answered only just before the next batch, so they arrive stale.
    Model "missing" gets an UNKNOWN_MODEL error.
    """

    def __init__(self, address: str, batch: int = 1):
        self.address = address
        self.batch = batch
        self.received: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(5)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # block rather than drop when a client lags
        socket.bind(self.address)
        self._ready.set()
        held: list[tuple[bytes, dict[str, Any]]] = []
        batch: list[tuple[bytes, dict[str, Any]]] = []
        try:
            while not self._stop.is_set():
                if not socket.poll(20):
                    continue
                client, frame = socket.recv_multipart()
                message = decode(frame)
                self.received.append(message)
                if message.get("model") == "hold":
                    held.append((client, self._answer(message)))
                    continue
                batch.append((client, self._answer(message)))
                if len(batch) >= self.batch:
                    for peer, reply in held + batch[::-1]:
                        socket.send_multipart([peer, encode(reply)])
                    held.clear()
                    batch.clear()
        finally:
            socket.close()
            context.term()

    @staticmethod
    def _answer(message: dict[str, Any]) -> dict[str, Any]:
        request_id = message["id"]
        op = message.get("op", "infer")
        if op == "health":
            return {"id": request_id, "ok": True, "status": "ready", "workers": [{"device": "cpu"}]}
        if op == "models":
            return {"id": request_id, "ok": True, "models": {"lstm": {"kind": "lstm", "vocab_size": 8192}},
                    "blob": b"\x00" * 16}
        if op == "cancel":
            return {"id": request_id, "ok": True, "cancelled": False}
        if message.get("model") == "missing":
            return error_reply(request_id, UNKNOWN_MODEL, "no model named 'missing'")
        tokens = message["inputs"]["tokens"]
        array = map_to_tensor(tokens) if is_tensor_map(tokens) else np.asarray(tokens)
        return {
            "id": request_id,
            "ok": True,
            "outputs": {"h": tensor_to_map(array.astype(np.float32) * 2), "length": int(array.size)},
            "timing": {"queue_us": 10, "compute_us": 20, "total_us": 35},
        }


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FakeServer]:
    fake = FakeServer(f"ipc://{tmp_path}/server.ipc")
    yield fake
    fake.close()


def test_sync_client_infer_errors_and_stale_replies(server: FakeServer) -> None:
    with Client(server.address, timeout=5) as client:
        reply = client.infer("lstm", {"tokens": [1, 2, 3]}, deadline_ms=500, priority=1)
        np.testing.assert_array_equal(reply.outputs["h"], np.array([2, 4, 6], np.float32))
        assert reply.outputs["length"] == 3
        assert reply.timing == {"queue_us": 10, "compute_us": 20, "total_us": 35}
        assert server.received[-1]["deadline_ms"] == 500 and server.received[-1]["priority"] == 1

        reply = client.infer("lstm", {"tokens": np.array([4, 5], dtype=np.int64)})
        assert is_tensor_map(server.received[-1]["inputs"]["tokens"])
        np.testing.assert_array_equal(reply.outputs["h"], [8, 10])

        with pytest.raises(ServerError) as caught:
            client.infer("missing", {"tokens": [1]})
        assert caught.value.code == UNKNOWN_MODEL
        assert "missing" in caught.value.message
        assert caught.value.request_id == server.received[-1]["id"]

        assert client.call({"id": "mine", "op": "health"})["id"] == "mine"
        assert client.health()["status"] == "ready"
        assert client.cancel(3)["cancelled"] is False

        client.timeout = 0.3
        with pytest.raises(TimeoutError):
            client.infer("hold", {"tokens": [9]})
        client.timeout = 5
        # The held reply now arrives first and must be skipped.
        reply = client.infer("lstm", {"tokens": [7]})
        np.testing.assert_array_equal(reply.outputs["h"], [14])


def test_async_client_routes_replies_sent_in_reverse(tmp_path: Path) -> None:
    fake = FakeServer(f"ipc://{tmp_path}/batch.ipc", batch=50)

    async def run() -> list[Any]:
        async with AsyncClient(fake.address, timeout=10) as client:
            return await asyncio.gather(
                *(client.infer("missing" if i == 17 else "lstm", {"tokens": [i, i + 1]}) for i in range(50)),
                return_exceptions=True,
            )

    try:
        results = asyncio.run(run())
    finally:
        fake.close()
    for i, result in enumerate(results):
        if i == 17:
            assert isinstance(result, ServerError) and result.code == UNKNOWN_MODEL
        else:
            np.testing.assert_array_equal(result.outputs["h"], [2 * i, 2 * i + 2])
    assert len({message["id"] for message in fake.received}) == 50


def test_async_client_handles_thousands_in_flight(tmp_path: Path) -> None:
    fake = FakeServer(f"ipc://{tmp_path}/many.ipc", batch=2000)

    async def run() -> list[Any]:
        async with AsyncClient(fake.address, timeout=20) as client:
            return await asyncio.gather(*(client.infer("lstm", {"tokens": [i]}) for i in range(2000)))

    try:
        results = asyncio.run(run())
    finally:
        fake.close()
    assert [float(result.outputs["h"][0]) for result in results] == [2.0 * i for i in range(2000)]


def test_async_client_timeout_and_close(server: FakeServer) -> None:
    async def run() -> None:
        client = AsyncClient(server.address, timeout=0.3)
        with pytest.raises(TimeoutError, match=server.address):
            await client.infer("hold", {"tokens": [1]})
        client.timeout = 10
        assert (await client.call({"id": "x", "op": "health"}))["id"] == "x"
        waiting = asyncio.create_task(client.infer("hold", {"tokens": [2]}))
        await asyncio.sleep(0.1)
        await client.close()
        with pytest.raises(ConnectionError, match="closed"):
            await waiting
        with pytest.raises(ConnectionError, match="closed"):
            await client.health()

    asyncio.run(run())


def test_cli_against_fake_server(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["health", "--address", server.address]) == 0
    assert '"status": "ready"' in capsys.readouterr().out

    assert cli_main(["models", "--address", server.address, "--json"]) == 0
    assert '"<16 bytes>"' in capsys.readouterr().out
    assert cli_main(["models", "--address", server.address]) == 0
    assert capsys.readouterr().out.startswith("lstm: kind lstm, vocab_size 8192\n")

    assert cli_main(["infer", "--address", server.address, "--model", "lstm", "--tokens", "1 2 3"]) == 0
    out = capsys.readouterr().out
    assert "h: float32 shape [3] [2, 4, 6]" in out and "timing: queue_us 10" in out

    assert cli_main(["infer", "--address", server.address, "--model", "lstm", "--text", "The parliament"]) == 0
    assert server.received[-1]["inputs"]["tokens"] == Vocabulary().encode("the parliament")
    capsys.readouterr()

    assert cli_main(["infer", "--address", server.address, "--model", "missing", "--tokens", "1"]) == 1
    assert capsys.readouterr().err.startswith("error UNKNOWN_MODEL: ")

    assert cli_main(["infer", "--address", server.address, "--model", "lstm", "--inputs", "[1]"]) == 1
    assert capsys.readouterr().err.startswith("error USAGE: ")


def test_float64_inputs_go_as_float32_and_values_float32_cannot_hold_are_refused_locally() -> None:
    import torch

    from batchmaker.clients.messages import infer_message

    x = np.array([[0.1, 2.5], [1e-3, -4.0]])
    sent = infer_message("m", {"x": x, "t": torch.tensor(x), "ids": np.arange(3)}, None, None)["inputs"]
    assert sent["x"].dtype == np.float32 and sent["t"].dtype == np.float32 and sent["ids"].dtype == np.int64
    np.testing.assert_array_equal(sent["x"], x.astype(np.float32))
    with pytest.raises(ValueError, match="input 'x': float64 values beyond float32's range"):
        infer_message("m", {"x": np.array([1e300])}, None, None)
