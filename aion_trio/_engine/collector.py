"""The cycle collector while engines are open: thresholds and freezing (``EngineConfig.gc_thresholds``, ``gc_freeze``).

Python's collector is process-wide, so this is process-wide bookkeeping: the
first engine to open with settings saves the process's thresholds, each sets
its own, and the last to close restores the saved ones (unless something else
changed them meanwhile) and thaws what the engines froze.

Why: a workflow step allocates a few hundred short-lived objects, almost all
freed by reference counting; with the default first threshold (700) the
collector runs every few steps and a full collection walks everything the
process holds, so its share of the CPU grows with the number of runs in
flight (measured by ``bench/step_cpu.py`` and ``bench/admission.py``).  A
larger first threshold makes young collections rare; freezing the start-up
heap (modules, definitions, the engine's services) takes it out of every
full collection for the engine's lifetime.
"""

from __future__ import annotations

import gc


class _Tuning:
    """The process's bookkeeping: how many tuned engines are open, what they replaced."""

    def __init__(self) -> None:
        self.open = 0
        self.saved: tuple[int, int, int] | None = None
        self.ours: tuple[int, int, int] | None = None
        self.froze = False
        #: Engines closing now with the collector paused, and whether it was enabled before.
        self.paused = 0
        self.was_enabled = False


_tuning = _Tuning()


def pause() -> None:
    """An engine's close begins: pause the cycle collector until :func:`resume`.

    Cancelling every run at close gives each parked run's task a ``Cancelled`` (with its
    outcome and traceback) before any of them unwinds, so a close of N resident runs
    allocates a few dozen objects per run at once; with the collector on, each batch of
    them triggers a collection that walks what the runs still hold.  Nothing of it is
    garbage for the collector (a run's objects are freed by reference counting as it
    unwinds), so those collections are pure cost.  Nested pauses (engines closing at
    once) count; the last :func:`resume` re-enables a collector that was enabled.
    """
    if _tuning.paused == 0:
        _tuning.was_enabled = gc.isenabled()
        gc.disable()
    _tuning.paused += 1


def resume() -> None:
    """An engine's close ended: the last one re-enables the collector paused by :func:`pause`."""
    _tuning.paused -= 1
    if _tuning.paused == 0 and _tuning.was_enabled:
        gc.enable()


def freeze() -> None:
    """Freeze what the process holds now (``gc.freeze``): not walked again until the last tuned engine closes."""
    gc.freeze()
    _tuning.froze = True


def enter(thresholds: tuple[int, int, int] | None, freezes: bool) -> bool:
    """An engine opens with ``thresholds`` (``None``: left alone); returns whether it takes part
    (it must then call :func:`leave` at close)."""
    if thresholds is None and not freezes:
        return False
    if _tuning.open == 0:
        _tuning.saved = gc.get_threshold()
    _tuning.open += 1
    if thresholds is not None:
        gc.set_threshold(*thresholds)
        _tuning.ours = thresholds
    return True


def leave() -> None:
    """An engine that took part closes: the last one restores the saved thresholds (unless
    something else changed them meanwhile) and thaws what was frozen."""
    _tuning.open -= 1
    if _tuning.open > 0:
        return
    if _tuning.ours is not None and _tuning.saved is not None and gc.get_threshold() == _tuning.ours:
        gc.set_threshold(*_tuning.saved)
    if _tuning.froze:
        gc.unfreeze()
    _tuning.saved, _tuning.ours, _tuning.froze = None, None, False
