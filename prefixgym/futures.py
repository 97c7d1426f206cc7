"""A future for service calls that works both with `.result()` and with `await`.

It wraps a `concurrent.futures.Future` completed by a worker thread (the engine's
scheduler, a training call, an HTTP client). It knows nothing about what it carries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class APIFuture(Generic[T]):
    def __init__(self, future: concurrent.futures.Future[T] | None = None) -> None:
        self._future: concurrent.futures.Future[T] = future or concurrent.futures.Future()

    @classmethod
    def completed(cls, value: T) -> APIFuture[T]:
        fut: APIFuture[T] = cls()
        fut.set_result(value)
        return fut

    def set_result(self, value: T) -> None:
        self._future.set_result(value)

    def set_exception(self, error: BaseException) -> None:
        self._future.set_exception(error)

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def future(self) -> concurrent.futures.Future[T]:
        """The underlying `concurrent.futures.Future` (the hosted service's name)."""
        return self._future

    async def result_async(self, timeout: float | None = None) -> T:
        """`await`-able result, with an optional timeout (the hosted service's name)."""
        async with asyncio.timeout(timeout):
            return await asyncio.wrap_future(self._future)

    def map(self, fn: Callable[[T], U]) -> APIFuture[U]:
        """A future of `fn(result)`, completed when this one is."""
        out: APIFuture[U] = APIFuture()

        def _done(f: concurrent.futures.Future[T]) -> None:
            error = f.exception()
            if error is not None:
                out.set_exception(error)
                return
            try:
                out.set_result(fn(f.result()))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                out.set_exception(e)

        self._future.add_done_callback(_done)
        return out

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._future).__await__()
