"""Payload codecs (issue 20, item 3): compression and AES-GCM encryption applied to every
stored payload, keys by id so they rotate, async codecs, replay through the chain, the
command line with and without the codec, and a tampered payload or a missing key as a
typed error naming the workflow and seq.

Engine-level tests run on the selected store (``store_url``: memory, SQLite or PostgreSQL);
the store is then read *without* the codec to check what it really holds.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from _clirunner import cli_runner

import aion_trio as aion
import aion_trio.testing
from aion_trio import _cli
from aion_trio._codec_store import CodecEventStore
from aion_trio._codecs import ENVELOPE_KEY, is_encoded
from aion_trio._epoch import epoch_closed
from aion_trio._wire import event_to_wire

SECRET = "card-4111-1111"
KEY_1 = bytes(range(32))
KEY_2 = bytes(range(32, 64))


def aes(current: str = "k1", **keys: bytes) -> aion.AesGcmCodec:
    return aion.AesGcmCodec(keys=keys or {"k1": KEY_1}, current=current)


#: What the command-line tests name with ``--codec test_codecs:CHAIN``.
CHAIN = [aion.ZlibCodec(), aes()]


@aion.activity
async def charge(order: dict[str, Any]) -> dict[str, Any]:
    return {"charged": order["card"], "amount": order["amount"]}


@aion.workflow
async def checkout(ctx: aion.WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
    receipt = await ctx.run(charge, order)
    approval = await ctx.wait_signal("approve")
    return {"receipt": receipt, "approval": approval}


ORDER = {"card": SECRET, "amount": 12}


async def raw_history(url: str, workflow_id: str) -> list[aion.Event]:
    """The history as the store holds it (no codec)."""
    async with aion.open_store(url) as store:
        return await store.events.read_history(workflow_id)


def user_payloads(events: list[aion.Event]) -> list[aion.Payload]:
    found = []
    for event in events:
        for name in ("input", "result", "payload", "value"):
            value = getattr(event.body, name, None)
            if isinstance(value, aion.Payload):
                found.append(value)
    return found


def key_ids(events: list[aion.Event]) -> list[str]:
    ids = []
    for payload in user_payloads(events):
        data = base64.b64decode(json.loads(payload.json)["data"])
        ids.append(aion.AesGcmCodec.key_id_of(data))
    return ids


async def run_checkout(engine: aion.Engine, workflow_id: str) -> Any:
    run = await engine.start(checkout, ORDER, workflow_id=workflow_id)
    await engine.signal(workflow_id, "approve", {"by": "ana"})
    with trio.fail_after(10):
        return await run.result()


EXPECTED = {"receipt": {"charged": SECRET, "amount": 12}, "approval": {"by": "ana"}}


async def test_payloads_round_trip_through_compression_and_encryption_and_are_stored_encrypted(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    config = aion.EngineConfig(codecs=CHAIN)
    async with aion.open_engine(url, workflows=[checkout], activities=[charge], config=config) as engine:
        assert await run_checkout(engine, "order-1") == EXPECTED
        seen = await engine.history("order-1")
    # The engine's history is plain ...
    assert user_payloads(seen)[0].value() == [ORDER]
    # ... the store's is not: every user payload is an envelope, the secret nowhere in it.
    stored = await raw_history(url, "order-1")
    assert [type(e.body) for e in stored] == [type(e.body) for e in seen]
    payloads = user_payloads(stored)
    assert len(payloads) == 5  # the input, the activity's input and result, the signal, the result
    assert all(is_encoded(p) for p in payloads)
    assert all(json.loads(p.json)[ENVELOPE_KEY] == ["zlib", "aes-gcm"] for p in payloads)
    assert SECRET not in json.dumps([event_to_wire(e) for e in stored])
    # The engine's own options stay readable by the engine (and stores) as they are.
    scheduled = next(e.body for e in stored if isinstance(e.body, aion.ActivityScheduled))
    assert not is_encoded(scheduled.options)


async def test_a_run_replays_through_the_codec_after_a_restart(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    config = aion.EngineConfig(codecs=CHAIN)
    async with aion.open_engine(url, workflows=[checkout], activities=[charge], config=config) as engine:
        await engine.start(checkout, ORDER, workflow_id="order-2")
        with trio.fail_after(10):
            while len(await engine.history("order-2")) < 4:  # the activity settled; waiting for the signal
                await trio.testing.wait_all_tasks_blocked()
    # A new engine replays the encrypted history (the activity's result decoded, not re-run).
    async with aion.open_engine(url, workflows=[checkout], activities=[charge], config=config) as engine:
        await engine.signal("order-2", "approve", {"by": "ana"})
        with trio.fail_after(10):
            assert await engine.result("order-2") == EXPECTED
    stored = await raw_history(url, "order-2")
    assert sum(isinstance(e.body, aion.ActivityScheduled) for e in stored) == 1


async def test_keys_rotate_old_payloads_still_decrypt_new_ones_use_the_current_key(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    old = aion.EngineConfig(codecs=[aes("k1", k1=KEY_1)])
    rotated = aion.EngineConfig(codecs=[aes("k2", k1=KEY_1, k2=KEY_2)])
    async with aion.open_engine(url, workflows=[checkout], activities=[charge], config=old) as engine:
        await engine.start(checkout, ORDER, workflow_id="order-3")
        with trio.fail_after(10):
            while len(await engine.history("order-3")) < 4:
                await trio.testing.wait_all_tasks_blocked()
    written_before = len(user_payloads(await raw_history(url, "order-3")))
    async with aion.open_engine(url, workflows=[checkout], activities=[charge], config=rotated) as engine:
        await engine.signal("order-3", "approve", {"by": "ana"})
        with trio.fail_after(10):
            assert await engine.result("order-3") == EXPECTED
    ids = key_ids(await raw_history(url, "order-3"))
    assert ids == ["k1"] * written_before + ["k2"] * (len(ids) - written_before)
    assert len(ids) > written_before
    # Without the old key, the payloads it wrote do not decrypt: a typed error, no fallback.
    only_new = aion.EngineConfig(codecs=[aes("k2", k2=KEY_2)])
    async with aion.open_engine(url, workflows=[checkout], activities=[charge], config=only_new) as engine:
        with pytest.raises(aion.PayloadCodecError) as raised:
            await engine.history("order-3")
    assert raised.value.workflow_id == "order-3"
    assert raised.value.seq == 1
    assert "no key with id 'k1'" in str(raised.value)


async def test_a_tampered_payload_is_a_typed_error_naming_the_workflow_and_seq(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    config = aion.EngineConfig(codecs=CHAIN)
    async with aion.open_engine(url, workflows=[checkout], activities=[charge], config=config) as engine:
        await run_checkout(engine, "order-4")
    stored = await raw_history(url, "order-4")
    # Copy the history into a fresh store with one byte of one ciphertext changed.
    target = next(i for i, e in enumerate(stored) if isinstance(e.body, aion.ActivityCompleted))
    body = stored[target].body
    envelope = json.loads(body.result.json)
    data = bytearray(base64.b64decode(envelope["data"]))
    data[-1] ^= 1
    envelope["data"] = base64.b64encode(bytes(data)).decode()
    tampered = aion.Event(
        workflow_id="order-4",
        seq=stored[target].seq,
        recorded_at=stored[target].recorded_at,
        body=type(body)(activity_id=body.activity_id, attempt=body.attempt, result=aion.Payload.of(envelope)),
    )
    copy = store_url()
    async with aion.open_store(copy) as store:
        await store.events.append("order-4", [*stored[:target], tampered, *stored[target + 1 :]], 0)
    async with aion.open_engine(copy, workflows=[checkout], activities=[charge], config=config) as engine:
        with pytest.raises(aion.PayloadCodecError) as raised:
            await engine.history("order-4")
    assert (raised.value.workflow_id, raised.value.seq) == ("order-4", stored[target].seq)
    assert raised.value.what == "ActivityCompleted.result"
    assert "wrong key or tampered payload" in str(raised.value)


class SlowKms:
    """An async codec (a KMS call): it awaits on each call and counts them."""

    name = "kms"

    def __init__(self) -> None:
        self.calls = 0
        self.release: trio.Event | None = None

    async def encode(self, data: bytes) -> bytes:
        self.calls += 1
        if self.release is not None:
            await self.release.wait()
        await trio.lowlevel.checkpoint()
        return data[::-1]

    async def decode(self, data: bytes) -> bytes:
        self.calls += 1
        await trio.lowlevel.checkpoint()
        return data[::-1]


async def test_an_async_codec_is_awaited_on_write_and_read_and_never_during_replay(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    kms = SlowKms()
    config = aion.EngineConfig(codecs=[kms, aion.ZlibCodec()])
    async with aion.open_engine(url, workflows=[checkout], activities=[charge], config=config) as engine:
        assert await run_checkout(engine, "order-5") == EXPECTED
    assert kms.calls > 0
    stored = await raw_history(url, "order-5")
    assert all(json.loads(p.json)[ENVELOPE_KEY] == ["kms", "zlib"] for p in user_payloads(stored))
    # Reading decodes each payload once; replaying what was read calls no codec.
    kms.calls = 0
    assert config.codecs is not None
    async with aion.open_store(url) as store:
        decoded = await CodecEventStore(store.events, config.codecs).read_history("order-5")
    assert kms.calls == len(user_payloads(stored))
    kms.calls = 0
    report = await aion.testing.replay(
        [checkout], [aion.testing.History("order-5", decoded)], activities=[charge]
    )
    assert report.ok
    assert kms.calls == 0


async def test_an_epoch_closed_while_an_async_codec_encodes_writes_nothing() -> None:
    """The recorder's epoch gate is checked before the append; an async codec awaits after it, so
    the codec store checks the gate again right before the write."""
    kms = SlowKms()
    kms.release = trio.Event()
    closed = False

    def gate(workflow_id: str) -> None:
        if closed:
            raise epoch_closed(workflow_id, None, "append encoded events")

    async with aion.open_store("memory://") as store:
        events = CodecEventStore(store.events, aion.CodecChain([kms]), gate=gate)
        event = aion.Event(
            workflow_id="w",
            seq=1,
            recorded_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
            body=aion.MarkerRecorded(name="m", value=aion.Payload.of(SECRET)),
        )
        async with trio.open_nursery() as nursery:
            errors: list[BaseException] = []

            async def append() -> None:
                try:
                    await events.append("w", [event], 0)
                except aion.EngineEpochClosed as exc:
                    errors.append(exc)

            nursery.start_soon(append)
            await trio.testing.wait_all_tasks_blocked()
            closed = True
            kms.release.set()
        assert len(errors) == 1
        assert await store.events.read_history("w") == []


def test_chains_refuse_bad_codecs_and_aes_refuses_bad_keys() -> None:
    with pytest.raises(ValueError, match="two codecs in one chain are named 'zlib'"):
        aion.CodecChain([aion.ZlibCodec(), aion.ZlibCodec()])
    with pytest.raises(TypeError, match="is not a codec"):
        aion.CodecChain([object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="must be 16, 24 or 32 bytes"):
        aion.AesGcmCodec(keys={"k": b"short"}, current="k")
    with pytest.raises(ValueError, match="current key id 'k2' is not among the keys"):
        aion.AesGcmCodec(keys={"k1": KEY_1}, current="k2")
    assert aion.EngineConfig(codecs=[]).codecs is None
    with pytest.raises(TypeError, match="codecs must be"):
        aion.EngineConfig(codecs="zlib")  # type: ignore[arg-type]


async def test_a_payload_naming_a_codec_that_is_not_configured_is_a_typed_error() -> None:
    written = await aion.CodecChain([aion.ZlibCodec(), aes()]).encode(aion.Payload.of(ORDER))
    with pytest.raises(aion.PayloadCodecError, match="encoded with codec 'aes-gcm', which is not configured"):
        await aion.CodecChain([aion.ZlibCodec()]).decode(written, workflow_id="w", seq=3, what="x")
    # A plain payload (written before the codec was configured) reads as it is.
    plain = aion.Payload.of(ORDER)
    assert await aion.CodecChain([aes()]).decode(plain, workflow_id="w", seq=1, what="x") is plain


# -- the command line ---------------------------------------------------------------


def invoke(*args: str) -> Any:
    return cli_runner().invoke(_cli.cli, list(args), prog_name="aion-trio")


@pytest.fixture
def encrypted_db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/enc.db"

    async def seed() -> None:
        config = aion.EngineConfig(codecs=CHAIN)
        async with aion.open_engine(url, workflows=[checkout], activities=[charge], config=config) as engine:
            await run_checkout(engine, "order-cli")

    trio.run(seed)
    return url


def test_the_cli_shows_encrypted_payloads_as_such_without_the_codec(encrypted_db: str) -> None:
    result = invoke("history", "order-cli", "--store", encrypted_db)
    assert result.exit_code == 0, result.output + result.stderr
    assert "<encrypted>" in result.output
    assert SECRET not in result.output
    shown = invoke("show", "order-cli", "--store", encrypted_db)
    assert shown.exit_code == 0, shown.output + shown.stderr
    assert "<encrypted>" in shown.output


def test_the_cli_decodes_payloads_with_the_codec(encrypted_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    result = invoke("--codec", "test_codecs:CHAIN", "history", "order-cli", "--store", encrypted_db)
    assert result.exit_code == 0, result.output + result.stderr
    assert SECRET in result.output
    assert "<encrypted>" not in result.output
    as_json = invoke(
        "--codec", "test_codecs:CHAIN", "history", "order-cli", "--json", "--store", encrypted_db
    )
    assert as_json.exit_code == 0, as_json.stderr
    first = json.loads(as_json.output.splitlines()[0])
    assert first["data"]["input"] == [ORDER]


def test_the_cli_with_a_wrong_key_says_which_event_does_not_decrypt(
    encrypted_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    result = invoke("--codec", "test_codecs:WRONG_KEY", "history", "order-cli", "--store", encrypted_db)
    assert result.exit_code != 0
    assert "workflow 'order-cli' seq 1" in result.stderr
    assert "wrong key or tampered payload" in result.stderr


WRONG_KEY = [aion.ZlibCodec(), aion.AesGcmCodec(keys={"k1": os.urandom(32)}, current="k1")]
#: This module as a ``-m test_codecs`` app: its definitions and its codecs.
workflows = [checkout]
activities = [charge]
codecs = CHAIN


def test_write_commands_use_the_apps_codecs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``aion-trio start/signal -m MODULE`` with no worker owning the store open an engine here:
    with the app's ``codecs`` (no ``--codec`` needed), so what they record is encrypted."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    url = f"sqlite:///{tmp_path}/writes.db"
    started = invoke(
        "start",
        "checkout",
        json.dumps(ORDER),
        "--id",
        "w-1",
        "--no-wait",
        "-m",
        "test_codecs",
        "--store",
        url,
    )
    assert started.exit_code == 0, started.output + started.stderr
    signalled = invoke("signal", "w-1", "approve", '{"by":"ana"}', "-m", "test_codecs", "--store", url)
    assert signalled.exit_code == 0, signalled.output + signalled.stderr
    stored = trio.run(raw_history, url, "w-1")
    assert user_payloads(stored)
    assert all(is_encoded(p) for p in user_payloads(stored))
    shown = invoke("--codec", "test_codecs:codecs", "history", "w-1", "--store", url)
    assert shown.exit_code == 0, shown.stderr
    assert SECRET in shown.output


async def test_an_engine_without_the_key_does_not_run_the_workflows_it_cannot_decode_and_carries_on(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    url = store_url()
    async with aion.open_engine(
        url, workflows=[checkout], activities=[charge], config=aion.EngineConfig(codecs=[aes()])
    ) as engine:
        await engine.start(checkout, ORDER, workflow_id="locked")
    wrong = aion.EngineConfig(codecs=[aion.AesGcmCodec(keys={"k1": KEY_2}, current="k1")])
    async with aion.open_engine(url, workflows=[checkout], activities=[charge], config=wrong) as engine:
        # The engine is up and works for new workflows; the locked one is not run.
        assert await run_checkout(engine, "fresh") == EXPECTED
        with pytest.raises(aion.PayloadCodecError, match="workflow 'locked' seq 1"):
            await engine.describe("locked")
    assert any(
        "could not recover" in r.getMessage() and "PayloadCodecError" in r.getMessage()
        for r in caplog.records
    )


@aion.workflow
async def echo_order(ctx: aion.WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
    return order


async def test_a_queued_runs_arguments_are_stored_through_the_codecs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A workflow queue keeps what to start in the store until the run is admitted: its
    arguments go through the codec chain there too, not only once they are in a history."""
    async with aion.open_store("memory://") as store:
        assert isinstance(store, aion.FlowStore)
        config = aion.EngineConfig(
            codecs=CHAIN, workflow_queues={"orders": aion.FlowLimit(concurrency=1)}, queue_poll_interval=60
        )
        async with aion.open_engine(store, workflows=[echo_order], config=config) as engine:
            # A full queue: the second entry stays queued, readable in the store as it is held.
            first = await engine.enqueue(echo_order, {"amount": 1}, queue="orders", workflow_id="o-1")
            second = await engine.enqueue(echo_order, ORDER, queue="orders", workflow_id="o-2")
            held = {run.workflow_id: run.data for run in await store.flow_runs("orders")}
            assert SECRET not in held["o-2"]
            assert is_encoded(aion.Payload.from_json_text(json.loads(held["o-2"])["args"]))
            with trio.fail_after(120):
                assert await first.result() == {"amount": 1}
                assert await second.result() == ORDER
