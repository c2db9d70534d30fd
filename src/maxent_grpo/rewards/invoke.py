"""Calling reward functions: each under its own time limit, ``async def`` ones concurrently.

TRL accepts ``async def`` reward functions (a judge model behind an HTTP API,
say); their coroutines are awaited together on one event loop, so K of them
take as long as the slowest. A call that exceeds its ``timeout_s`` fails the
batch with a message naming the function. Python cannot kill a thread, so a
hung synchronous call is left running in a daemon thread (it cannot keep the
process alive at exit); code that may really hang belongs in a subprocess,
as the sandboxed code rewards do.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class CallResult:
    """What one reward function gave: its value, or why there is none."""

    value: Any = None
    error: str | None = None
    exception: BaseException | None = None


def _failed(exc: BaseException) -> CallResult:
    return CallResult(error=f"raised {type(exc).__name__}: {exc}", exception=exc)


def _timed_out(limit: float) -> CallResult:
    return CallResult(error=f"did not return within timeout_s={limit:g} s")


def _in_thread(fn: Callable[[], Any], limit: float | None) -> CallResult:
    """``fn()`` in a daemon thread, waited on for at most ``limit`` seconds."""
    box: list[CallResult] = []

    def target() -> None:
        try:
            box.append(CallResult(value=fn()))
        except Exception as exc:  # handed back with the function's name; nothing is defaulted
            box.append(_failed(exc))

    thread = threading.Thread(target=target, daemon=True, name="reward-call")
    thread.start()
    thread.join(limit)
    return box[0] if box else _timed_out(limit)


def call_all(funcs: Sequence[Callable], timeouts: Sequence[float | None], kwargs: dict) -> list[CallResult]:
    """One :class:`CallResult` per function, in order."""
    results: list[CallResult | None] = [None] * len(funcs)
    pending: dict[int, Any] = {}
    for k, (fn, limit) in enumerate(zip(funcs, timeouts)):
        if limit is None:
            try:
                value = fn(**kwargs)
            except Exception as exc:  # handed back with the function's name
                results[k] = _failed(exc)
                continue
            result = CallResult(value=value)
        else:
            result = _in_thread(lambda fn=fn: fn(**kwargs), limit)
        if result.error is None and inspect.isawaitable(result.value):
            pending[k] = result.value
        else:
            results[k] = result
    if pending:
        for k, result in _await_all(pending, timeouts).items():
            results[k] = result
    return results  # type: ignore[return-value]


def _await_all(pending: dict[int, Any], timeouts: Sequence[float | None]) -> dict[int, CallResult]:
    async def one(k: int, awaitable) -> CallResult:
        limit = timeouts[k]
        try:
            return CallResult(value=await asyncio.wait_for(awaitable, limit))
        except asyncio.TimeoutError:
            return _timed_out(limit)
        except Exception as exc:  # handed back with the function's name
            return _failed(exc)

    async def gather() -> list[CallResult]:
        return list(await asyncio.gather(*(one(k, a) for k, a in pending.items())))

    # A loop of our own in a thread: the caller may already be inside one (a notebook).
    done = _in_thread(lambda: asyncio.run(gather()), None)
    if done.error is not None:
        raise RuntimeError(f"awaiting the async reward functions failed: {done.error}") from done.exception
    return dict(zip(pending, done.value))
