"""The dynamic generator on a thread of its own, so that requests from any thread or event loop join one batch.

Callers submit jobs and read their events from a queue; the thread admits new jobs and cancellations between
steps (the generator itself is not thread-safe) and sleeps while there is nothing to do. `close()` lets the jobs in
flight end, then stops the thread, so that the generator (and the model it holds) can be freed.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from typing import AsyncIterator, Callable, Iterator, TypeVar, Union

from exl2.errors import Exl2Error
from exl2.generation.dynamic import DynamicGenerator, Event, Job
from exl2.generation.output import GenerationResult

Sink = Callable[[Union[Event, BaseException]], None]
T = TypeVar("T")


class BatchWorker:
    def __init__(self, generator: DynamicGenerator):
        self.generator = generator
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        self._closed = False

    def submit(self, job: Job, sink: Sink) -> None:
        """Queue `job`; `sink` receives its events, or the exception that ended it, on the worker thread."""
        with self._start:
            if self._closed:
                raise Exl2Error("This engine was closed, so it takes no new requests.")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="exl2-generator", daemon=True)
                self._thread.start()
            self._inbox.put(("add", job, sink))     # under the lock: every job queued before close() runs

    def cancel(self, job: Job) -> None:
        self._inbox.put(("cancel", job, None))

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` on the generator's thread between steps (the generator is not thread-safe), after the jobs
        submitted before it were queued; its result, or its exception raised here. With no thread yet it runs
        here, under the lock that starts one."""
        with self._start:
            if self._closed:
                raise Exl2Error("This engine was closed, so it takes no new requests.")
            if self._thread is None:
                return fn()
            done: Future = Future()
            self._inbox.put(("call", fn, done))
        return done.result()

    def close(self, timeout: float | None = None) -> None:
        """Take no new jobs, let those in flight run to their ends, then stop the thread (waiting up to `timeout`
        seconds for it; None: until it stopped). Calling it again does nothing more."""
        with self._start:
            self._closed = True
            thread = self._thread
        if thread is not None and thread.is_alive():
            self._inbox.put(("close", None, None))      # wakes the thread if it sleeps on the inbox
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _take(self, block: bool) -> None:
        while True:
            try:
                op, job, sink = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if op == "add":
                try:
                    self.generator.enqueue(job)
                    self._sinks[job.id] = sink
                except Exception as e:  # a prompt that does not fit: only this job fails
                    _deliver(sink, e)
            elif op == "close":
                continue
            elif op == "call":  # (fn, its Future) in the job and sink places
                try:
                    sink.set_result(job())
                except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
                    sink.set_exception(e)
            elif not job.done:
                self.generator.cancel(job)
                self._sinks.pop(job.id, None)

    def _run(self) -> None:
        while True:
            self._take(block=not self.generator.has_work() and not self._closed)
            if not self.generator.has_work():
                if self._closed:
                    self._take(block=False)     # closed: no job can be queued after this last look
                    if not self.generator.has_work():
                        return
                continue
            try:
                events = self.generator.iterate()
            except Exception as e:  # e.g. out of GPU memory: end every job in flight with the error, keep serving
                for job in list(self.generator.active) + list(self.generator.queue):
                    self.generator.cancel(job)
                    sink = self._sinks.pop(job.id, None)
                    if sink is not None:
                        _deliver(sink, e)
                continue
            for event in events:
                sink = self._sinks.get(event.job.id)
                if sink is None:
                    continue
                if event.result is not None:
                    del self._sinks[event.job.id]
                _deliver(sink, event)

    def stream(self, job: Job) -> Iterator[Event]:
        """The job's events, on the calling thread; leaving early cancels it."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(job, q.put)
        try:
            while True:
                event = _checked(q.get())
                yield event
                if event.result is not None:
                    return
        finally:
            if not job.done:
                self.cancel(job)

    def run_all(self, jobs: list[Job]) -> list[GenerationResult]:
        """Run jobs together to their ends, on the calling thread; results in order. An error cancels the rest."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        for job in jobs:
            self.submit(job, q.put)
        results: dict[int, GenerationResult] = {}
        try:
            while len(results) < len(jobs):
                event = _checked(q.get())
                if event.result is not None:
                    results[event.job.id] = event.result
        finally:
            for job in jobs:
                if job.id not in results:
                    self.cancel(job)
        return [results[j.id] for j in jobs]

    async def astream(self, job: Job) -> AsyncIterator[Event]:
        """The job's events in the running event loop; closing the iterator early cancels the job."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self.submit(job, lambda item: loop.call_soon_threadsafe(q.put_nowait, item))
        try:
            while True:
                event = _checked(await q.get())
                yield event
                if event.result is not None:
                    return
        finally:
            if not job.done:
                self.cancel(job)


def _checked(item: Union[Event, BaseException]) -> Event:
    """An event, or the exception that ended the job raised in the consumer."""
    if isinstance(item, BaseException):
        raise item
    return item


def _deliver(sink: Sink, item) -> None:
    """A consumer that went away (its event loop closed) must not stop the thread that serves the others."""
    try:
        sink(item)
    except RuntimeError:
        pass
