"""Run a generator ahead in a background thread, a bounded number of items ahead."""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def prefetched(items: Iterable[T], depth: int) -> Iterator[T]:
    """Produce the next ``depth`` items in a background thread while the caller works.

    Collation is CPU work on already-preprocessed samples; a thread (not a process)
    keeps the tensors shareable without copies. An error in the producer is raised
    in the consumer at the item where it happened.
    """
    if depth == 0:
        yield from items
        return
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def fill():
        try:
            for item in items:
                buffer.put(item)
        except BaseException as error:  # hand the error to the consumer
            buffer.put(error)
        buffer.put(done)

    threading.Thread(target=fill, daemon=True, name="weft-prefetch").start()
    while (item := buffer.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item
