"""The codec chain around remote activity dispatch.

A dispatcher given to :func:`~aion_trio.open_engine` (the PostgreSQL task
queues) puts an attempt's payloads somewhere else than this process: with
``EngineConfig.codecs`` set it gets them encoded (:class:`EncodingDispatcher`),
and the worker that runs the attempt decodes them and encodes the result
(:func:`decoding_executor`), so a task row holds what an event row holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, final

import attrs

from .._codecs import CodecChain
from .._errors import PayloadCodecError
from .._events import FailureCause
from .._payload import Payload
from .protocol import (
    ActivityDispatcher,
    ActivityExecutor,
    ActivityOutcome,
    ActivityRequest,
    error_from_exception,
)


def _refused(exc: PayloadCodecError) -> ActivityOutcome:
    # Never run on (or record) what did not decode: the attempt fails, naming why.
    return ActivityOutcome(error=error_from_exception(exc, FailureCause.TERMINAL))


async def encode_request(chain: CodecChain, request: ActivityRequest) -> ActivityRequest:
    details = request.heartbeat_details
    return attrs.evolve(
        request,
        input=await chain.encode(request.input),
        heartbeat_details=None if details is None else await chain.encode(details),
    )


async def decode_request(chain: CodecChain, request: ActivityRequest) -> ActivityRequest:
    where = f"activity:{request.activity_id} attempt {request.attempt}"

    async def decode(payload: Payload, what: str) -> Payload:
        return await chain.decode(
            payload, workflow_id=request.workflow_id, seq=None, what=f"{what} of {where}"
        )

    details = request.heartbeat_details
    return attrs.evolve(
        request,
        input=await decode(request.input, "input"),
        heartbeat_details=None if details is None else await decode(details, "heartbeat details"),
    )


async def encode_outcome(chain: CodecChain, outcome: ActivityOutcome) -> ActivityOutcome:
    if outcome.result is None:
        return outcome
    return attrs.evolve(outcome, result=await chain.encode(outcome.result))


async def decode_outcome(
    chain: CodecChain, request: ActivityRequest, outcome: ActivityOutcome
) -> ActivityOutcome:
    if outcome.result is None:
        return outcome
    result = await chain.decode(
        outcome.result,
        workflow_id=request.workflow_id,
        seq=None,
        what=f"result of activity:{request.activity_id} attempt {request.attempt}",
    )
    return attrs.evolve(outcome, result=result)


@final
class EncodingDispatcher:
    """Hands ``inner`` each request with its payloads encoded; decodes the result it reports."""

    def __init__(self, inner: ActivityDispatcher, chain: CodecChain) -> None:
        self._inner = inner
        self._chain = chain

    async def dispatch(self, request: ActivityRequest) -> ActivityOutcome:
        outcome = await self._inner.dispatch(await encode_request(self._chain, request))
        try:
            return await decode_outcome(self._chain, request, outcome)
        except PayloadCodecError as exc:
            return _refused(exc)


@final
class DecodingDispatcher:
    """The in-process side of an :class:`EncodingDispatcher`: a delegating dispatcher's
    local work arrives encoded; ``inner`` runs it plain."""

    def __init__(self, inner: ActivityDispatcher, chain: CodecChain) -> None:
        self._inner = inner
        self._chain = chain

    async def dispatch(self, request: ActivityRequest) -> ActivityOutcome:
        try:
            plain = await decode_request(self._chain, request)
        except PayloadCodecError as exc:
            return _refused(exc)
        return await encode_outcome(self._chain, await self._inner.dispatch(plain))


def decoding_executor(execute: ActivityExecutor, chain: CodecChain) -> ActivityExecutor:
    """A remote worker's executor: decode the claimed task's payloads, run it, encode the result."""

    async def run(request: ActivityRequest, on_heartbeat: Callable[[Any], None] | None) -> ActivityOutcome:
        try:
            plain = await decode_request(chain, request)
        except PayloadCodecError as exc:
            return _refused(exc)
        return await encode_outcome(chain, await execute(plain, on_heartbeat))

    return run
