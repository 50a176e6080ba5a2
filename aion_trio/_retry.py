"""Retry policies, backoffs and resolved activity options (docs/concepts.md, "Retries and timeouts").

Everything here is validated at construction (a negative delay, a maximum
below the initial, zero attempts: a clear ``ValueError``) and converts to and
from JSON, because the *resolved* options of every activity are recorded in
its ``ActivityScheduled`` event: replay and routing read the recorded options,
never the code's current defaults.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, Union, final

import attrs

from ._ids import validate_task_queue

#: The longest duration any option, timer or deadline may have (100 years): far
#: enough for any business process, and ``now + duration`` stays a valid datetime.
MAX_DURATION_SECONDS = 100 * 365.25 * 86400


def duration_seconds(value: timedelta | float | int, what: str, *, allow_zero: bool = True) -> float:
    """Seconds of a duration given as a number of seconds or a ``timedelta``.

    Anything else (a str, a bool), a negative, infinite or NaN value, or one
    longer than :data:`MAX_DURATION_SECONDS` raises ``TypeError``/``ValueError``
    naming ``what``.  The one check every duration the engine accepts goes through.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise TypeError(f"{what} must be a duration (seconds as int or float, or a timedelta), got {value!r}")
    try:
        seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0 or (not allow_zero and seconds == 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a finite duration {bound}, got {value!r}")
    if seconds > MAX_DURATION_SECONDS:
        raise ValueError(
            f"{what} is {value!r}, longer than the limit of 100 years; "
            "for no limit at all leave it unset (None)"
        )
    return seconds


def _delay(value: timedelta | float | int) -> float:
    return duration_seconds(value, "backoff delay")


def _optional_seconds(value: timedelta | float | int | None, what: str) -> float | None:
    return None if value is None else duration_seconds(value, what, allow_zero=False)


@final
@attrs.frozen
class Fixed:
    """The same delay before every retry."""

    delay: float = attrs.field(converter=_delay)

    def delay_after(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt``: always ``delay``."""
        return self.delay

    def to_json(self) -> dict[str, Any]:
        """The backoff as a JSON object (``kind``: ``fixed``)."""
        return {"kind": "fixed", "delay": self.delay}


@final
@attrs.frozen(kw_only=True)
class Exponential:
    """``initial * multiplier ** (attempt - 1)``, capped at ``maximum``."""

    initial: float = attrs.field(converter=_delay)
    multiplier: float = 2.0
    maximum: float = attrs.field(converter=_delay)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.multiplier, bool) or not math.isfinite(self.multiplier) or self.multiplier < 1:
            raise ValueError(f"Exponential multiplier must be a finite number >= 1, got {self.multiplier!r}")
        if self.maximum < self.initial:
            raise ValueError(
                f"Exponential maximum ({self.maximum}s) must be at least the initial delay ({self.initial}s)"
            )

    def delay_after(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based), capped at ``maximum``."""
        exponent = max(attempt - 1, 0)
        try:
            value = self.initial * self.multiplier**exponent
        except OverflowError:
            return self.maximum
        return min(value, self.maximum)

    def to_json(self) -> dict[str, Any]:
        """The backoff as a JSON object (``kind``: ``exponential``)."""
        return {
            "kind": "exponential",
            "initial": self.initial,
            "multiplier": self.multiplier,
            "maximum": self.maximum,
        }


@final
@attrs.frozen(kw_only=True)
class Linear:
    """``initial + increment * (attempt - 1)``, capped at ``maximum``."""

    initial: float = attrs.field(converter=_delay)
    increment: float = attrs.field(converter=_delay)
    maximum: float = attrs.field(converter=_delay)

    def __attrs_post_init__(self) -> None:
        if self.maximum < self.initial:
            raise ValueError(
                f"Linear maximum ({self.maximum}s) must be at least the initial delay ({self.initial}s)"
            )

    def delay_after(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based), capped at ``maximum``."""
        return min(self.initial + self.increment * max(attempt - 1, 0), self.maximum)

    def to_json(self) -> dict[str, Any]:
        """The backoff as a JSON object (``kind``: ``linear``)."""
        return {
            "kind": "linear",
            "initial": self.initial,
            "increment": self.increment,
            "maximum": self.maximum,
        }


Backoff = Union[Fixed, Exponential, Linear]


def backoff_from_json(data: Mapping[str, Any]) -> Backoff:
    kind = data.get("kind")
    if kind == "fixed":
        return Fixed(data["delay"])
    if kind == "exponential":
        return Exponential(initial=data["initial"], multiplier=data["multiplier"], maximum=data["maximum"])
    if kind == "linear":
        return Linear(initial=data["initial"], increment=data["increment"], maximum=data["maximum"])
    raise ValueError(f"unknown backoff kind {kind!r}")


def _type_names(value: Iterable[type[BaseException] | str]) -> tuple[str, ...]:
    names: list[str] = []
    for item in value:
        if isinstance(item, type) and issubclass(item, BaseException):
            names.append(item.__qualname__)
        elif isinstance(item, str) and item:
            names.append(item)
        else:
            raise TypeError(f"non_retryable takes exception classes or their names, got {item!r}")
    return tuple(names)


def _max_attempts(value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            "max_attempts counts every attempt including the first and must be an int >= 1, "
            f"or None for no limit, got {value!r}"
        )
    return value


def _check_backoff(instance: object, attribute: object, value: object) -> None:
    if not isinstance(value, (Fixed, Exponential, Linear)):
        raise TypeError(f"backoff must be Fixed, Exponential or Linear, got {value!r}")


def _default_backoff() -> Backoff:
    return Exponential(initial=1.0, multiplier=2.0, maximum=60.0)


@final
@attrs.frozen(kw_only=True)
class RetryPolicy:
    """How often an activity is attempted.

    ``max_attempts`` counts the first attempt (``max_attempts=1``: no retry);
    ``None`` (the default) sets no limit: the activity is retried until it
    succeeds, fails terminally, or its ``schedule_to_close`` runs out.
    Any exception is retried within the budget except ``TerminalError`` and
    the types listed in ``non_retryable`` (classes, or names matched against
    the exception's class name and those of its bases).  Attempt timeouts and
    policy refusals are retry-eligible too.
    """

    max_attempts: int | None = attrs.field(default=None, converter=_max_attempts)
    backoff: Backoff = attrs.field(factory=_default_backoff, validator=_check_backoff)
    non_retryable: tuple[str, ...] = attrs.field(default=(), converter=_type_names)

    def is_non_retryable(self, exc: BaseException) -> bool:
        """Whether ``exc``'s class, or a base class, is named in ``non_retryable``."""
        names = {cls.__qualname__ for cls in type(exc).__mro__} | {cls.__name__ for cls in type(exc).__mro__}
        return any(name in names for name in self.non_retryable)

    def to_json(self) -> dict[str, Any]:
        """The policy as a JSON object (read back by ``from_json``)."""
        return {
            "max_attempts": self.max_attempts,
            "backoff": self.backoff.to_json(),
            "non_retryable": list(self.non_retryable),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RetryPolicy:
        """The policy ``to_json`` wrote."""
        return cls(
            max_attempts=data["max_attempts"],
            backoff=backoff_from_json(data["backoff"]),
            non_retryable=tuple(data.get("non_retryable", ())),
        )


def _queues(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError("fallback_queues takes a sequence of queue names, not one string")
    out = tuple(value)
    for q in out:
        if not isinstance(q, str) or not q:
            raise ValueError(f"fallback queue names must be non-empty str, got {q!r}")
    return out


@final
@attrs.frozen(kw_only=True)
class ActivityOptions:
    """The resolved options of one scheduled activity (what is recorded)."""

    retry: RetryPolicy | None = None
    #: Per-attempt bound, seconds.
    timeout: float | None = None
    #: Bound across all attempts and backoffs, seconds, from scheduling.
    schedule_to_close: float | None = None
    #: An attempt that does not heartbeat for this long fails as a timeout.
    heartbeat_timeout: float | None = None
    task_queue: str = "default"
    fallback_queues: tuple[str, ...] = attrs.field(default=(), converter=_queues)
    #: Record ``ActivityAdvisoryExhausted`` before the terminal failure.
    advisory: bool = False
    #: Order among attempts waiting for a flow-control slot: lower first (FIFO within).
    priority: int = 0

    def to_json(self) -> dict[str, Any]:
        """The options as a JSON object (the form ``ActivityScheduled.options`` records)."""
        return {
            "retry": self.retry.to_json() if self.retry else None,
            "timeout": self.timeout,
            "schedule_to_close": self.schedule_to_close,
            "heartbeat_timeout": self.heartbeat_timeout,
            "task_queue": self.task_queue,
            "fallback_queues": list(self.fallback_queues),
            "advisory": self.advisory,
            # Only when set: records of activities without a priority stay as they were.
            **({"priority": self.priority} if self.priority else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, task_queue: str) -> ActivityOptions:
        """Options as recorded; unknown or missing keys fall back to defaults (old records)."""
        retry = data.get("retry")
        return cls(
            retry=RetryPolicy.from_json(retry) if retry else None,
            timeout=data.get("timeout"),
            schedule_to_close=data.get("schedule_to_close"),
            heartbeat_timeout=data.get("heartbeat_timeout"),
            task_queue=data.get("task_queue") or task_queue,
            fallback_queues=tuple(data.get("fallback_queues") or ()),
            advisory=bool(data.get("advisory", False)),
            priority=int(data.get("priority") or 0),
        )


UNSET: Any = attrs.make_class("Unset", [], repr=False)()
"""Marks an option the caller did not pass (``None`` passed explicitly means "none")."""

OPTION_NAMES = (
    "retry",
    "timeout",
    "schedule_to_close",
    "heartbeat_timeout",
    "task_queue",
    "fallback_queues",
    "advisory",
    "priority",
)


def explicit(**options: Any) -> dict[str, Any]:
    """The options a layer sets explicitly (drops ``UNSET``)."""
    return {k: v for k, v in options.items() if v is not UNSET}


def check_layer(layer: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Validate one layer's explicitly set options early (at decoration or call time)."""
    out = dict(layer)
    unknown = set(out) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(
            f"{where}: unknown activity option(s) {', '.join(sorted(unknown))}; known: {', '.join(OPTION_NAMES)}"
        )
    for key in ("timeout", "schedule_to_close", "heartbeat_timeout"):
        if out.get(key) is not None:
            out[key] = _optional_seconds(out[key], f"{where}: {key}")
    if out.get("retry") is not None and not isinstance(out["retry"], RetryPolicy):
        raise TypeError(f"{where}: retry must be a RetryPolicy or None, got {out['retry']!r}")
    if out.get("task_queue") is not None:
        validate_task_queue(out["task_queue"], f"{where}: task_queue")
    if out.get("fallback_queues") is not None:
        out["fallback_queues"] = _queues(out["fallback_queues"])
    if "advisory" in out and not isinstance(out["advisory"], bool):
        raise TypeError(f"{where}: advisory must be a bool, got {out['advisory']!r}")
    if out.get("priority") is not None and (
        isinstance(out["priority"], bool) or not isinstance(out["priority"], int)
    ):
        raise TypeError(f"{where}: priority must be an int (lower runs first), got {out['priority']!r}")
    return out


def resolve_options(*layers: Mapping[str, Any], default_task_queue: str) -> ActivityOptions:
    """Per call over per activity over engine default: the first layer that sets a key wins.

    A layer setting ``retry=None`` explicitly means "no retry policy" and wins too.
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            merged.setdefault(key, value)
    cleaned = {k: v for k, v in merged.items() if v is not None}
    cleaned.setdefault("task_queue", default_task_queue)
    return ActivityOptions(**cleaned)
