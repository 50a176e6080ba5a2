"""Remote activity workers over PostgreSQL: engines dispatch
attempts as ``activity_tasks`` rows; ``aion-trio worker --activities-only``
processes (and in-process workers) claim and run them.

Real PostgreSQL (a fresh schema per test), real subprocesses killed with
SIGKILL.  Time is real here (the workers are other processes): every wait is
for a condition, bounded by ``trio.fail_after``, never a sleep that hopes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import tasks_app
import trio
from aion_trio_postgres import PostgresStore, open_postgres_store, open_task_dispatcher

import aion_trio as aion
from aion_trio import (
    ActivityCompleted,
    ActivityFailed,
    ActivityFallbackRouted,
    ActivityRequest,
    ActivityStarted,
    Event,
    OutcomeKind,
    Payload,
)

HERE = Path(__file__).resolve().parent
FAST_URL_OPTIONS = {"task_lease_ttl": "1.5", "poll_interval": "0.2"}


def query(url: str, text: str, params: Any = None) -> list[tuple[Any, ...]]:
    base, _, rest = url.partition("?")
    schema = rest.split("schema=", 1)[1].split("&", 1)[0]
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
        cur = conn.execute(text, params)
        return cur.fetchall() if cur.description else []


def wait_until_ready(proc: subprocess.Popen[str]) -> None:
    """Read the worker's output until it says it is claiming (attempt timeouts count queue time)."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "ready: activity worker" in line:
            return
    raise AssertionError("the worker exited before it was ready:\n" + "".join(seen))


@contextlib.contextmanager
def worker_process(url: str, *queues: str) -> Iterator[subprocess.Popen[str]]:
    """``aion-trio worker --activities-only`` in a subprocess, ready to claim; SIGKILLed on exit."""
    args = [sys.executable, "-c", "from aion_trio._cli import main; main()", "worker", "--activities-only"]
    args += ["--store", url, "--activities", "tasks_app:app", "--concurrency", "8", "--drain-timeout", "1"]
    for queue in queues:
        args += ["--queue", queue]
    env = {**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        args, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    reader: threading.Thread | None = None
    try:
        wait_until_ready(proc)
        # Keep reading, so a chatty worker never blocks on a full pipe.
        reader = threading.Thread(target=proc.stdout.read, daemon=True)
        reader.start()
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if reader is not None:
            reader.join(timeout=10)
        proc.stdout.close()


@contextlib.asynccontextmanager
async def remote_engine(
    url: str, **dispatcher_options: Any
) -> AsyncIterator[tuple[aion.Engine, PostgresStore]]:
    """An engine whose activities all go to remote workers (none run in this process)."""
    async with (
        open_postgres_store(url) as store,
        open_task_dispatcher(store, **dispatcher_options) as dispatcher,
        aion.open_engine(
            store,
            workflows=tasks_app.app.workflows,
            activities=tasks_app.app.activities,
            dispatcher=dispatcher,
        ) as engine,
    ):
        yield engine, store


def trail(history: list[Event]) -> list[tuple[str, int]]:
    """The activity trail: (event type, attempt) in history order."""
    return [
        (type(e.body).__name__, e.body.attempt)
        for e in history
        if isinstance(e.body, (ActivityStarted, ActivityFailed, ActivityCompleted, ActivityFallbackRouted))
    ]


async def wait_for_file(path: Path, seconds: float = 15) -> None:
    with trio.fail_after(seconds):
        while True:
            if await trio.Path(path).exists():
                return
            await trio.sleep(0.02)


@pytest.fixture
def url(fresh_store_url: Callable[..., str]) -> str:
    return fresh_store_url(**FAST_URL_OPTIONS)


async def test_a_remote_worker_process_runs_every_attempt_with_the_engines_retry_semantics(url: str) -> None:
    """An engine with no local activity execution completes workflows whose activities run in an
    ``aion-trio worker --activities-only`` subprocess: async and thread activities, retries with
    backoff (attempt numbers in the trail), a per-attempt timeout and a heartbeat timeout each
    followed by the next attempt, a terminal error, and a policy refusal hopping to the fallback
    queue (served by the same worker)."""
    with worker_process(url, tasks_app.QUEUE, tasks_app.FALLBACK) as proc:
        async with remote_engine(url) as (engine, _store):
            runs = {
                "echo": await engine.start(tasks_app.run_echo, {"n": 1}, workflow_id="echo"),
                "flaky": await engine.start(tasks_app.run_flaky, workflow_id="flaky"),
                "timeout": await engine.start(tasks_app.run_slow_first, workflow_id="timeout"),
                "heartbeat": await engine.start(tasks_app.run_silent_first, workflow_id="heartbeat"),
                "terminal": await engine.start(tasks_app.run_terminal, workflow_id="terminal"),
                "fallback": await engine.start(tasks_app.run_fallback, workflow_id="fallback"),
            }
            results: dict[str, Any] = {}
            with trio.fail_after(20):
                for name, run in runs.items():
                    results[name] = await run.result()
            histories = {name: await engine.history(name) for name in runs}

    here = os.getpid()
    assert [r["value"] for r in results["echo"]] == [{"n": 1}, {"n": 1}]
    assert {r["pid"] for r in results["echo"]} == {proc.pid} != {here}

    assert (results["flaky"]["attempt"], results["flaky"]["pid"]) == (3, proc.pid)
    assert trail(histories["flaky"]) == [
        ("ActivityStarted", 1),
        ("ActivityFailed", 1),
        ("ActivityStarted", 2),
        ("ActivityFailed", 2),
        ("ActivityStarted", 3),
        ("ActivityCompleted", 3),
    ]
    failures = [e for e in histories["flaky"] if isinstance(e.body, ActivityFailed)]
    assert [f.body.error.message for f in failures] == ["flaky failure 1", "flaky failure 2"]
    # The backoff (0.3 s) separates a failure from the next start.
    starts = [e for e in histories["flaky"] if isinstance(e.body, ActivityStarted)]
    assert (starts[1].recorded_at - failures[0].recorded_at).total_seconds() >= 0.3

    assert results["timeout"]["attempt"] == 2
    (timed_out,) = [e.body for e in histories["timeout"] if isinstance(e.body, ActivityFailed)]
    assert (timed_out.attempt, timed_out.final, timed_out.error.cause.value) == (1, False, "timeout")

    assert results["heartbeat"]["attempt"] == 2
    (silent,) = [e.body for e in histories["heartbeat"] if isinstance(e.body, ActivityFailed)]
    assert (silent.error.type, silent.attempt, silent.final) == ("HeartbeatTimeout", 1, False)

    assert results["terminal"][:2] == ["failed", "TerminalError"]
    assert trail(histories["terminal"]) == [("ActivityStarted", 1), ("ActivityFailed", 1)]

    assert (results["fallback"]["queue"], results["fallback"]["pid"]) == (tasks_app.FALLBACK, proc.pid)
    hops = [e.body for e in histories["fallback"] if isinstance(e.body, ActivityFallbackRouted)]
    assert [(h.from_task_queue, h.to_task_queue) for h in hops] == [(tasks_app.QUEUE, tasks_app.FALLBACK)]

    # Every attempt went through the task table; the timed-out one was cancelled there.
    rows = query(url, "SELECT workflow_id, attempt, status FROM activity_tasks ORDER BY workflow_id, attempt")
    assert ("timeout", 1, "cancelled") in rows or ("timeout", 1, "done") in rows
    assert ("flaky", 3, "done") in rows
    assert len([r for r in rows if r[0] == "flaky"]) == 3


def _heartbeat_markers(history: list[Event]) -> list[Any]:
    return [
        e.body.value.value()
        for e in history
        if isinstance(e.body, aion.MarkerRecorded) and e.body.name.startswith("heartbeat:")
    ]


async def test_a_remote_attempts_heartbeat_details_reach_the_next_attempt_remote_or_local(url: str) -> None:
    """Heartbeat details of attempts on a worker subprocess travel with its heartbeats to the
    engine, which records them (throttled) and gives them to the next attempt: on the worker
    again (a retry), or in the engine's own process (a fallback hop to a local queue).  An
    activity calling complete_async() there fails at once: not supported on remote workers."""
    with worker_process(url, tasks_app.QUEUE) as proc:
        async with remote_engine(url, queues=[tasks_app.QUEUE]) as (engine, _store):
            counted = await engine.start(tasks_app.run_count_on, workflow_id="count")
            hopped = await engine.start(tasks_app.run_progress_then_local, workflow_id="hop")
            unsupported = await engine.start(tasks_app.run_goes_async, workflow_id="async")
            with trio.fail_after(20):
                count_result = await counted.result()
                hop_result = await hopped.result()
                async_result = await unsupported.result()
            count_history = await engine.history("count")
            hop_history = await engine.history("hop")
    assert (count_result["start"], count_result["attempt"], count_result["pid"]) == (4, 3, proc.pid)
    assert _heartbeat_markers(count_history)[:2] == [
        {"attempt": 1, "details": 2},
        {"attempt": 2, "details": 4},
    ], "each remote attempt's last details are recorded, in the engine's history"
    assert (hop_result["start"], hop_result["queue"], hop_result["pid"]) == (10, tasks_app.LOCAL, os.getpid())
    assert _heartbeat_markers(hop_history)[0] == {"attempt": 1, "details": 10}
    # complete_async() on a remote worker is refused at once (a final failure), never left waiting.
    assert async_result[0] == "AsyncCompletionUnsupported"
    (task_details,) = query(
        url, "SELECT heartbeat_details FROM activity_tasks WHERE workflow_id = 'count' AND attempt = 3"
    )
    assert task_details == ("6",), "attempt 3's row holds its own last details (4 + 2)"


async def test_a_sigkilled_worker_attempt_is_reaped_and_rerun_as_the_same_attempt(
    url: str, tmp_path: Path
) -> None:
    """A worker SIGKILLed mid-attempt stops renewing its lease; the reaper returns the task to
    pending, a second worker runs the *same* attempt, and no retry budget is spent (no
    ActivityFailed, one ActivityStarted)."""
    with worker_process(url, tasks_app.QUEUE) as first:
        async with remote_engine(url) as (engine, _store):
            run = await engine.start(tasks_app.run_mark_and_wait, str(tmp_path), "crash", workflow_id="crash")
            await wait_for_file(tmp_path / "crash.started")
            assert (tmp_path / "crash.started").read_text() == str(first.pid)
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=10)
            with worker_process(url, tasks_app.QUEUE) as second:
                with trio.fail_after(20):
                    result = await run.result()
            history = await engine.history("crash")
    assert (result["pid"], result["attempt"]) == (second.pid, 1)
    assert trail(history) == [("ActivityStarted", 1), ("ActivityCompleted", 1)]
    assert query(url, "SELECT attempt, status, lost_count FROM activity_tasks") == [(1, "done", 1)]
    assert not (tmp_path / "crash.stopped").exists()  # SIGKILL: no cleanup ran


async def _until(condition: Callable[[], bool], seconds: float = 15) -> None:
    """Poll an engine's own state (the worker is another process) until it holds, bounded."""
    with trio.fail_after(seconds):
        while True:
            if condition():
                return
            await trio.sleep(0.02)


async def test_a_run_awaiting_a_remote_attempt_is_evicted_and_the_outcome_replays_it(
    url: str, tmp_path: Path
) -> None:
    """A run whose only work in flight is an attempt on a remote worker is evicted when idle;
    a signal replays it (and it is evicted again); the attempt's outcome, recorded through
    the workflow's current recorder, replays it once more and it finishes.  One attempt ran."""
    with worker_process(url, tasks_app.QUEUE) as worker:
        async with (
            open_postgres_store(url) as store,
            open_task_dispatcher(store) as dispatcher,
            aion.open_engine(
                store,
                workflows=tasks_app.app.workflows,
                activities=tasks_app.app.activities,
                dispatcher=dispatcher,
                config=aion.EngineConfig(evict_after=0.2),
            ) as engine,
        ):
            run = await engine.start(tasks_app.run_gated, str(tmp_path), "gated", workflow_id="gated")
            await wait_for_file(tmp_path / "gated.started")
            await _until(lambda: engine.statistics().evicted_runs == 1)
            assert (await engine.describe("gated")).residency == "evicted"
            await engine.signal("gated", "note", "hello")
            # Replayed by the signal, parked again on the attempt, evicted again.
            await _until(lambda: engine.statistics().evictions >= 2 and engine.statistics().evicted_runs == 1)
            (tmp_path / "gated.go").write_text("go")
            with trio.fail_after(20):
                result = await run.result()
            stats = engine.statistics()
            history = await engine.history("gated")
    assert result[0] == "hello"
    assert (result[1]["pid"], result[1]["attempt"]) == (worker.pid, 1)
    assert stats.reloads >= 2
    assert trail(history) == [("ActivityStarted", 1), ("ActivityCompleted", 1)]
    assert query(url, "SELECT attempt, status, lost_count FROM activity_tasks") == [(1, "done", 0)]


async def _in_process_worker(
    url: str, nursery: trio.Nursery, stop: trio.Event, *, concurrency: int = 4, queues: tuple[str, ...] = ()
) -> str:
    worker_id: str = await nursery.start(
        lambda task_status: aion.run_activity_worker(
            url,
            tasks_app.app.activities,
            list(queues or (tasks_app.QUEUE,)),
            concurrency=concurrency,
            drain_timeout=0,
            stop=stop,
            task_status=task_status,
        )
    )
    return worker_id


async def test_two_workers_never_run_the_same_task(url: str, tmp_path: Path) -> None:
    """Two workers claiming from one queue at once (FOR UPDATE SKIP LOCKED): every task runs
    exactly once (a second run would fail to create its file exclusively) and both workers
    take a share."""
    stop = trio.Event()
    async with remote_engine(url) as (engine, _store), trio.open_nursery() as nursery:
        first = await _in_process_worker(url, nursery, stop, concurrency=3)
        second = await _in_process_worker(url, nursery, stop, concurrency=3)
        runs = [
            await engine.start(tasks_app.run_records, str(tmp_path), 10, workflow_id=f"batch{i}")
            for i in range(3)
        ]
        with trio.fail_after(20):
            for run in runs:
                assert len(await run.result()) == 10
        stop.set()
    assert len(os.listdir(tmp_path)) == 30
    rows = query(
        url, "SELECT worker_id, count(*) FROM activity_tasks WHERE status = 'done' GROUP BY worker_id"
    )
    assert sum(n for _, n in rows) == 30
    assert {w for w, _ in rows} == {first, second}


async def test_a_stale_attempt_result_is_ignored(url: str) -> None:
    """A worker whose lease was reaped (another worker now runs the attempt) cannot write its
    result: the outcome write is guarded by (id, attempt, worker, running).  The engine gets
    worker-lost (the same attempt again), then the current worker's result."""
    from aion_trio_postgres import reap_expired
    from aion_trio_postgres._tasks import ActivityWorker

    async def never(request: ActivityRequest, beat: Any) -> aion.ActivityOutcome:
        raise AssertionError("not run in this test")  # pragma: no cover

    request = ActivityRequest(
        workflow_id="wf",
        run_id="0" * 32,
        activity_id=1,
        activity_type="echo",
        input=Payload.of([1]),
        attempt=1,
        task_queue=tasks_app.QUEUE,
        options=Payload.of({}),
    )
    async with (
        open_postgres_store(url) as store,
        open_task_dispatcher(store, reap_interval=3600) as dispatcher,
    ):
        old, new = (
            ActivityWorker(
                store=store,
                execute=never,
                queues=(tasks_app.QUEUE,),
                concurrency=1,
                lease_ttl=30,
                poll_interval=1,
            )
            for _ in range(2)
        )
        outcomes: list[aion.ActivityOutcome] = []

        async def dispatch() -> None:
            outcomes.append(await dispatcher.dispatch(request))

        with trio.fail_after(15):  # the dispatch must return worker-lost
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dispatch)
                while True:
                    if claimed := await old.claim(1):
                        break
                    await trio.sleep(0.02)
                (task_id, claimed_request, _), *_ = claimed
                query(
                    url,
                    "UPDATE activity_tasks SET lease_expires_at = clock_timestamp() - interval '1 second'",
                )
                assert await reap_expired(store) == [task_id]
        assert [o.kind for o in outcomes] == [OutcomeKind.WORKER_LOST]

        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dispatch)  # the driver re-dispatches the same attempt
                while True:
                    if await new.claim(1):
                        break
                    await trio.sleep(0.02)
                late = aion.ActivityOutcome(result=Payload.of("stale"))
                assert not await old.complete(task_id, 1, late)  # reaped: no longer this worker's
                assert not await new.complete(task_id, 0, late)  # not the current attempt
                assert await new.complete(task_id, 1, aion.ActivityOutcome(result=Payload.of("current")))
    assert claimed_request.attempt == 1
    assert [o.result for o in outcomes[1:]] == [Payload.of("current")]
    assert query(url, "SELECT status, result, lost_count FROM activity_tasks") == [("done", '"current"', 1)]


async def test_cancelling_a_workflow_stops_its_running_task_on_the_worker(url: str, tmp_path: Path) -> None:
    """The engine cancels the dispatch of a cancelled workflow's activity; the task row is marked
    cancelled and the worker stops the attempt (its cancellation runs the activity's cleanup)."""
    stop = trio.Event()
    async with remote_engine(url) as (engine, _store), trio.open_nursery() as nursery:
        await _in_process_worker(url, nursery, stop)
        run = await engine.start(tasks_app.run_mark_and_wait, str(tmp_path), "cancel", workflow_id="cancel")
        await wait_for_file(tmp_path / "cancel.started")
        await engine.cancel("cancel", "no longer needed")
        await wait_for_file(tmp_path / "cancel.stopped", seconds=10)
        with pytest.raises(aion.WorkflowFailure):
            await run.result()
        stop.set()
    assert query(url, "SELECT status FROM activity_tasks") == [("cancelled",)]


async def test_a_store_without_task_queues_is_refused_by_the_worker(tmp_path: Path) -> None:
    with pytest.raises(aion.NoTaskQueues, match="has no activity task queues"):
        await aion.run_activity_worker(f"sqlite:///{tmp_path}/a.db", tasks_app.app.activities, ["q"])


@aion.workflow
async def echo_here(ctx: aion.WorkflowContext, value: Any) -> Any:
    """``echo`` on the default queue: kept in the engine's process by a dispatcher given ``queues``."""
    return await ctx.run(tasks_app.echo, value)


async def test_a_remote_worker_with_the_engines_codecs_sees_plain_payloads_and_task_rows_hold_encrypted_ones(
    url: str,
) -> None:
    """With ``EngineConfig.codecs``, an activity task leaves the engine encrypted (its row holds
    envelopes, never the value), the worker given the same codecs decodes it, runs it and
    encrypts its result, and the engine decodes that result for the workflow.  A worker
    without the key fails the attempt naming the workflow; nothing runs on what did not decrypt."""
    secret = "card-4111-1111"
    key = bytes(range(32))
    codecs = [aion.ZlibCodec(), aion.AesGcmCodec(keys={"k1": key}, current="k1")]
    stop = trio.Event()
    async with (
        open_postgres_store(url) as store,
        open_task_dispatcher(store, queues=[tasks_app.QUEUE]) as dispatcher,
        aion.open_engine(
            store,
            workflows=[*tasks_app.app.workflows, echo_here],
            activities=tasks_app.app.activities,
            dispatcher=dispatcher,
            config=aion.EngineConfig(codecs=codecs),
        ) as engine,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(
            lambda task_status: aion.run_activity_worker(
                url,
                tasks_app.app.activities,
                [tasks_app.QUEUE],
                drain_timeout=0,
                stop=stop,
                codecs=codecs,
                task_status=task_status,
            )
        )
        run = await engine.start(tasks_app.run_echo, {"card": secret}, workflow_id="enc")
        with trio.fail_after(30):
            first, second = await run.result()
        assert first["value"] == {"card": secret}
        assert second["value"] == {"card": secret}
        # The queue the dispatcher keeps local runs in-process on the plain payloads.
        here = await engine.start(echo_here, {"card": secret}, workflow_id="here")
        with trio.fail_after(30):
            assert (await here.result())["value"] == {"card": secret}
        stop.set()
    rows = query(url, "SELECT input, result FROM activity_tasks ORDER BY id")
    assert len(rows) == 2
    for input_text, result_text in rows:
        for text in (input_text, result_text):
            assert text.startswith('{"$aion_codec":["zlib","aes-gcm"]')
            assert secret not in text


async def test_a_remote_worker_without_the_key_fails_the_attempt_instead_of_running_it(url: str) -> None:
    codecs = [aion.AesGcmCodec(keys={"k1": bytes(range(32))}, current="k1")]
    wrong = [aion.AesGcmCodec(keys={"k1": bytes(range(1, 33))}, current="k1")]
    stop = trio.Event()
    async with (
        open_postgres_store(url) as store,
        open_task_dispatcher(store) as dispatcher,
        aion.open_engine(
            store,
            workflows=tasks_app.app.workflows,
            activities=tasks_app.app.activities,
            dispatcher=dispatcher,
            config=aion.EngineConfig(codecs=codecs),
        ) as engine,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(
            lambda task_status: aion.run_activity_worker(
                url,
                tasks_app.app.activities,
                [tasks_app.QUEUE],
                drain_timeout=0,
                stop=stop,
                codecs=wrong,
                task_status=task_status,
            )
        )
        run = await engine.start(tasks_app.run_echo, "x", workflow_id="wrong-key")
        with trio.fail_after(30), pytest.raises(aion.WorkflowFailure) as failure:
            await run.result()
        stop.set()
    assert "PayloadCodecError: workflow 'wrong-key': input of activity:0" in failure.value.error.message
    assert "wrong key or tampered payload" in failure.value.error.message
