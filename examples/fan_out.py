"""Fan-out/fan-in and a race: many activities at once with ``ctx.start`` + ``ctx.gather``,
then the first of two answers with ``ctx.wait_first``.

    python examples/fan_out.py                        # 8 chunks, primes below 20000
    python examples/fan_out.py --chunks 20 --limit 100000 --db /tmp/fan.db

Fan-out: the workflow splits ``[0, limit)`` into ``--chunks`` ranges and starts
one ``count_primes`` activity per range.  ``ctx.start`` returns a handle at once
(nothing waits yet), so every activity is recorded in one batch and they run
concurrently (plain ``def`` activities run in worker threads).  Fan-in:
``ctx.gather(*handles)`` waits for all of them and gives the results in the
order of the handles, whichever finished first.

Race: the workflow then asks two mirrors for the same answer and takes the
first.  ``ctx.wait_first`` returns the handle whose outcome was *recorded*
first, so a replay picks the same winner even if timings differ.  When the
workflow returns, the engine cancels the loser (``ActivityCancelled`` in the
history): the slow mirror's 60-second wait does not hold anything up.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import trio

import aion_trio as aion


@aion.activity
def count_primes(low: int, high: int) -> int:
    """How many primes are in ``[low, high)`` (a plain function: runs in a worker thread)."""
    return sum(1 for n in range(max(low, 2), high) if all(n % d for d in range(2, int(n**0.5) + 1)))


MIRROR_DELAY = {"nearby": 0.01, "far-away": 60.0}  # seconds; the far one is having a bad day


@aion.activity
async def ask_mirror(mirror: str, question: str) -> str:
    await trio.sleep(MIRROR_DELAY[mirror])  # cancelled mid-wait if another mirror wins
    return f"{mirror} says {question} is fine"


@aion.workflow
async def count_and_race(ctx: aion.WorkflowContext, limit: int, chunks: int) -> dict[str, Any]:
    # Fan-out: one handle per chunk; nothing is awaited yet.
    size = -(-limit // chunks)  # ceiling division
    handles = [ctx.start(count_primes, low, min(low + size, limit)) for low in range(0, limit, size)]
    # Fan-in: all results, in handle order.
    per_chunk = await ctx.gather(*handles)

    # Race: the same question to two mirrors; the first recorded answer wins.
    nearby = ctx.start(ask_mirror, "nearby", "release 1.2")
    far = ctx.start(ask_mirror, "far-away", "release 1.2")
    first = await ctx.wait_first(nearby, far)
    answer = await first  # already resolved: gives its result at once
    return {"primes": sum(per_chunk), "per_chunk": per_chunk, "answer": answer}


async def main(db: Path, limit: int, chunks: int) -> None:
    async with aion.open_engine(
        f"sqlite:///{db}", workflows=[count_and_race], activities=[count_primes, ask_mirror]
    ) as engine:
        run = await engine.start(count_and_race, limit, chunks)
        result = await run.result()
        history = await engine.history(run.workflow_id)
    # What the history says about the activities: which ran, and which the end of the run cancelled.
    scheduled = {e.body.activity_id: e.body for e in history if isinstance(e.body, aion.ActivityScheduled)}
    fan_out = [body for body in scheduled.values() if body.activity_type == count_primes.name]
    last_scheduled = max(
        e.seq
        for e in history
        if isinstance(e.body, aion.ActivityScheduled) and e.body.activity_type == count_primes.name
    )
    first_completed = min(e.seq for e in history if isinstance(e.body, aion.ActivityCompleted))
    cancelled = [
        json.loads(scheduled[e.body.activity_id].input.json)[0]
        for e in history
        if isinstance(e.body, aion.ActivityCancelled)
    ]
    together = "all" if last_scheduled < first_completed else "NOT all"
    print(f"fan-out: {len(fan_out)} count_primes activities for [0, {limit}), {together} scheduled at once")
    print(f"fan-in: {result['primes']} primes below {limit}; per chunk {result['per_chunk']}")
    print(f"race: {result['answer']}; cancelled when the workflow returned: {', '.join(cancelled) or 'none'}")


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limit", type=int, default=20000, help="count the primes below this")
    parser.add_argument("--chunks", type=int, default=8, help="how many activities to fan out to")
    parser.add_argument("--db", type=Path, help="SQLite file (default: one in a new temporary directory)")
    args = parser.parse_args()
    if args.limit < 1 or args.chunks < 1:
        parser.error("--limit and --chunks must be positive")
    if args.db is not None:
        trio.run(main, args.db, args.limit, args.chunks)
        return
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(main, Path(tmp) / "fan_out.db", args.limit, args.chunks)


if __name__ == "__main__":
    cli()
