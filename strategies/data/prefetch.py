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
    stop = threading.Event()

    def offer(item) -> bool:  # False once the consumer has gone
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def fill():
        try:
            for item in items:
                if not offer(item):
                    return
        except BaseException as error:  # hand the error to the consumer
            offer(error)
        offer(done)

    thread = threading.Thread(target=fill, daemon=True, name="weft-prefetch")
    thread.start()
    try:
        while (item := buffer.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # A consumer that stops early (an error, enough prompts, the last step) ends the
        # producer here and waits for its current item: left running into interpreter exit,
        # a producer inside torch's C++ (a collate's torch.cat) is torn down there and aborts
        # the process ("terminate called without an active exception").
        stop.set()
        thread.join()
