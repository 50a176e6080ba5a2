"""The local commands seam (issue 16).

The inbox drainer applies commands through the engine's local commands, a
protocol the wiring hands it (``_hub.InboxHub``), not through the client's
private methods or an import of the engine: here it drives a fake.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import trio

from aion_trio import NotRunning
from aion_trio._commands import (
    CancelCommand,
    IdReusePolicy,
    PendingCommand,
    QueryCommand,
    ReopenCommand,
    SignalCommand,
    StartCommand,
    TerminateCommand,
)
from aion_trio._inbox import InboxDrainer, apply_command
from aion_trio._payload import Payload


@attrs.frozen
class _Started:
    workflow_id: str
    run_id: str
    created: bool


class FakeLocalCommands:
    """Records each command applied; the signal to ``ended`` is refused."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.admitting = True

    def decode(self, payload: Payload) -> Any:
        return payload.value()

    async def start(
        self,
        workflow: str,
        args: Sequence[Any],
        *,
        workflow_id: str | None,
        id_reuse: IdReusePolicy,
        task_queue: str | None,
        request_id: str | None,
    ) -> _Started:
        await trio.lowlevel.checkpoint()
        self.calls.append(("start", workflow, list(args), workflow_id, id_reuse, task_queue, request_id))
        assert workflow_id is not None
        return _Started(workflow_id, "run-1", created=True)

    async def signal(self, workflow_id: str, name: str, payload: Payload, request_id: str | None) -> None:
        await trio.lowlevel.checkpoint()
        if workflow_id == "ended":
            raise NotRunning(workflow_id, "completed", f"signal {name!r} to")
        self.calls.append(("signal", workflow_id, name, payload.value(), request_id))

    async def cancel(self, workflow_id: str, reason: str, request_id: str | None) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append(("cancel", workflow_id, reason, request_id))

    async def terminate(self, workflow_id: str, reason: str, request_id: str | None) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append(("terminate", workflow_id, reason, request_id))

    async def reopen(self, workflow_id: str, request_id: str | None) -> _Started:
        await trio.lowlevel.checkpoint()
        self.calls.append(("reopen", workflow_id, request_id))
        return _Started(workflow_id, "run-2", created=False)

    async def query(self, workflow_id: str, name: str, arguments: Payload) -> Any:
        await trio.lowlevel.checkpoint()
        self.calls.append(("query", workflow_id, name, arguments.value()))
        return {"answer": 42}


class FakeInbox:
    def __init__(self, commands: list[PendingCommand]) -> None:
        self.pending = commands
        self.acked: list[tuple[int, bool, str]] = []

    async def pending_commands(self, limit: int) -> list[PendingCommand]:
        await trio.lowlevel.checkpoint()
        return self.pending[:limit]

    async def ack_command(self, command_id: int, outcome: Any) -> None:
        await trio.lowlevel.checkpoint()
        self.acked.append((command_id, outcome.ok, outcome.message))
        self.pending = [p for p in self.pending if p.command_id != command_id]


@attrs.frozen
class _Settings:
    inbox_batch: int = 10
    inbox_poll_interval: float | None = None


async def test_the_inbox_applies_each_command_through_the_local_commands_it_is_handed() -> None:
    local = FakeLocalCommands()
    inbox = FakeInbox(
        [
            PendingCommand(
                command_id=1,
                command=StartCommand(workflow_id="w", workflow_type="echo", args=Payload.of([1, 2])),
            ),
            PendingCommand(
                command_id=2, command=SignalCommand(workflow_id="w", name="go", payload=Payload.of(3))
            ),
            PendingCommand(command_id=3, command=SignalCommand(workflow_id="ended", name="go")),
            PendingCommand(command_id=4, command=CancelCommand(workflow_id="w", reason="r", request_id="k")),
            PendingCommand(command_id=5, command=TerminateCommand(workflow_id="w", reason="t")),
            PendingCommand(command_id=6, command=ReopenCommand(workflow_id="w")),
            PendingCommand(
                command_id=7, command=QueryCommand(workflow_id="w", name="q", args=Payload.of([5]))
            ),
        ]
    )
    drainer = InboxDrainer(commands=local, inbox=inbox, config=_Settings(), limiter=trio.CapacityLimiter(1))  # type: ignore[arg-type]
    assert await drainer.drain() == 7
    assert local.calls == [
        ("start", "echo", [1, 2], "w", IdReusePolicy.ALLOW_DUPLICATE, None, "inbox:1"),
        ("signal", "w", "go", 3, "inbox:2"),
        ("cancel", "w", "r", "k"),  # the command's own request id wins over inbox:N
        ("terminate", "w", "t", "inbox:5"),
        ("reopen", "w", "inbox:6"),
        ("query", "w", "q", [5]),
    ]
    assert [ok for _, ok, _ in inbox.acked] == [True, True, False, True, True, True, True]
    assert inbox.acked[0][2] == "started workflow 'w' run run-1"
    assert "completed" in inbox.acked[2][2]
    assert inbox.acked[5][2] == "reopened workflow 'w' run run-2"
    assert inbox.acked[6][2] == '{"answer":42}'


async def test_a_drain_applies_nothing_once_the_local_commands_stop_admitting() -> None:
    local = FakeLocalCommands()
    local.admitting = False
    inbox = FakeInbox([PendingCommand(command_id=1, command=CancelCommand(workflow_id="w"))])
    drainer = InboxDrainer(commands=local, inbox=inbox, config=_Settings(), limiter=trio.CapacityLimiter(1))  # type: ignore[arg-type]
    assert await drainer.drain() == 0
    assert local.calls == []
    assert inbox.acked == []


async def test_apply_command_answers_a_started_run_as_attached_when_it_was_not_created() -> None:
    class Attaching(FakeLocalCommands):
        async def start(self, workflow: str, args: Sequence[Any], **kwargs: Any) -> _Started:
            await trio.lowlevel.checkpoint()
            return _Started(kwargs["workflow_id"], "run-0", created=False)

    outcome = await apply_command(Attaching(), StartCommand(workflow_id="w", workflow_type="echo"), 9)
    assert outcome.ok
    assert outcome.message == "attached to existing workflow 'w' run run-0"
