"""StallWatchdog's thread: it watches the training loop's last beat, reads the stacks of its own process, and
publishes where its rank is to the default process group's key-value store, where the other ranks read it.

The training loop only assigns one tuple to :attr:`Watchdog.beat` (an atomic store under the GIL): no lock, no sync,
no collective. Everything else happens on the watchdog's daemon thread, which never takes a lock the main thread
could hold while it is stuck, and talks to the store through its own client with a short timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_tfdebug.functional.stall_checks import (
    Frame,
    RankRecord,
    Wait,
    allowance,
    classify_stack,
    default_stall_after,
    phase_kind,
)

STORE_PREFIX = "tfdebug_stall"
STORE_TIMEOUT_S = 5.0
"""The watchdog's own store client gives up after this long: a store that cannot be reached is said, never waited on."""

_LIBRARY = tuple(
    os.path.normpath(p)
    for p in {
        *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # the pack's own frames (its hooks)
    }
)


def library_file(path: str, prefixes: tuple[str, ...] = _LIBRARY) -> bool:
    """Whether ``path`` belongs to Python, an installed package or the pack (under one of ``prefixes``), not to the
    user's code."""
    path = os.path.normpath(path)
    return path.startswith("<") or any(path.startswith(p) for p in prefixes)


def frames_of(frame: Any) -> list[Frame]:
    """The stack of ``frame`` (a live frame object), outermost first, each marked as library code or the user's."""
    return [Frame(f.filename, f.lineno or 0, f.name, library_file(f.filename)) for f in traceback.extract_stack(frame)]


def dump_stacks(main_ident: int) -> str:
    """Every thread of this process with its Python stack (the main thread first), as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()  # a snapshot of every thread's current frame; takes no lock of the threads
    order = sorted(frames, key=lambda ident: (ident != main_ident, names.get(ident, "")))
    out = []
    for ident in order:
        name = names.get(ident, "unknown")
        out.append(f'--- thread "{name}" (id {ident}){" [main]" if ident == main_ident else ""}')
        out.append("".join(traceback.format_stack(frames[ident])).rstrip())
    return "\n".join(out)


def profiler_running() -> bool:
    """Whether a torch profiler (Lightning's or ``torch.profiler``) is recording in this process, asked from any
    thread (``torch._C._autograd._profiler_enabled()`` answers for the calling thread only)."""
    profiler = sys.modules.get("torch.autograd.profiler")
    return bool(getattr(profiler, "_is_profiler_enabled", False))


def default_store() -> Any:
    """A client of the default process group's store of its own (a clone, with a short timeout), or None when
    ``torch.distributed`` is not initialised. Raises what the store raises when it cannot be reached."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    with contextlib.suppress(Exception):  # a store that cannot be cloned is used as it is (reads check first)
        store = store.clone()  # its own connection: never queued behind a request of the main thread
    store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return store


@dataclass
class Stall:
    """What the watchdog saw when it fired: this rank's record, the stacks of its process, and the other ranks'
    records (None: unreadable, ``unreadable`` says why)."""

    own: RankRecord
    stacks: str
    others: list[RankRecord] | None
    unreadable: str | None
    stall_after: float


class Watchdog:
    """One daemon thread per process that fires ``on_stall(stall)`` once per stall.

    Args:
        rank: this process's global rank; ``world_size``: the number of ranks.
        on_stall: called on the watchdog thread with a :class:`Stall`.
        stall_after: seconds without progress; None: from the run's own batch times
            (:func:`~lightning_tfdebug.functional.stall_checks.default_stall_after`).
        poll_s: how often the thread looks (None: from ``stall_after``).
        store: a function that returns the store client (called on the thread), or None for one process.
        run_key: the part of the store keys that tells this fit from another in the same process group.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        on_stall: Callable[[Stall], None],
        stall_after: float | None = None,
        store: Callable[[], Any] | None = None,
        run_key: str = "0",
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.on_stall = on_stall
        self.stall_after = stall_after
        self.poll_s = min(1.0, stall_after / 4) if stall_after else 1.0
        self.publish_s = min(15.0, max(self.poll_s, (stall_after or 60.0) / 4))
        self._store_factory = store
        self._store: Any = None
        self.store_error: str | None = None
        self.key_prefix = f"{STORE_PREFIX}/{run_key}/rank"
        #: ``(count, step, phase, monotonic time)`` of the training loop's last hook: the one thing the hot path writes.
        self.beat: tuple[int, int, str, float] = (0, 0, "set-up", time.monotonic())
        #: the last training batch's duration in seconds (host arithmetic in the hot path), sampled by the thread
        self.batch_s: float | None = None
        self.batches: deque[float] = deque(maxlen=64)
        self.fired = 0
        self._main = threading.main_thread().ident or 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ main thread
    def mark(self, step: int, phase: str) -> None:
        """Record progress: a hook ran at ``step`` in ``phase`` (one tuple assignment)."""
        self.beat = (self.beat[0] + 1, step, phase, time.monotonic())

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tfdebug-stall-watchdog", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 2 * STORE_TIMEOUT_S) -> bool:
        """Stop the thread (it removes its store key) and wait for it; True when it has ended."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ the thread
    def effective_stall_after(self) -> float:
        return self.stall_after if self.stall_after is not None else default_stall_after(list(self.batches))

    def _run(self) -> None:
        seen = -1
        last_batch: float | None = None
        last_publish = 0.0
        fired_at = -1
        try:
            if self.world_size > 1 and self._store_factory is not None:
                self._connect()
            while not self._stop.wait(self.poll_s):
                count, step, phase, at = self.beat
                if count != seen:
                    seen = count
                    batch_s = self.batch_s
                    if batch_s is not None and batch_s is not last_batch:  # a batch that ended since the last look
                        self.batches.append(batch_s)
                        last_batch = batch_s
                idle = time.monotonic() - at
                budget = self.effective_stall_after()
                wait = self._own_wait() if idle > budget / 2 else None
                now = time.monotonic()
                if now - last_publish >= self.publish_s or (wait is not None and now - last_publish >= self.poll_s):
                    self._publish(RankRecord(self.rank, step, phase, idle, *(_wait_fields(wait))))
                    last_publish = now
                if wait is None or count == fired_at:
                    continue
                kind = phase_kind(phase, wait.kind, profiler_running())
                if idle > allowance(budget, kind):
                    fired_at = count
                    self.fired += 1
                    self.on_stall(self._stall(RankRecord(self.rank, step, phase, idle, *_wait_fields(wait)), budget))
        except Exception as err:  # the watchdog must never take the run down; it says so once, on stderr
            say_now(f"lightning_tfdebug: the stall watchdog stopped on rank {self.rank}: {type(err).__name__}: {err}")
        finally:
            self._unpublish()

    def _own_wait(self) -> Wait:
        frame = sys._current_frames().get(self._main)
        frames = frames_of(frame) if frame is not None else []
        return classify_stack(frames, distributed=self.world_size > 1)

    def _stall(self, own: RankRecord, budget: float) -> Stall:
        stacks = dump_stacks(self._main)
        if self.world_size <= 1:
            return Stall(own, stacks, None, None, budget)
        self._publish(own)
        others = self._read_others(wait_for_where=min(2.0, 2 * self.poll_s), stale_after=budget / 2)
        if others is None:
            return Stall(own, stacks, None, self.store_error or "no store", budget)
        return Stall(own, stacks, others, None, budget)

    # ------------------------------------------------------------------ the store
    def _connect(self) -> None:
        try:
            self._store = self._store_factory() if self._store_factory is not None else None
        except Exception as err:
            self._store, self.store_error = None, f"{type(err).__name__}: {err}"

    def _publish(self, record: RankRecord) -> None:
        if self._store is None:
            return
        value = {
            "step": record.step,
            "phase": record.phase,
            "idle_s": record.idle_s,
            "wall": time.time(),
            "kind": record.kind,
            "where": record.where,
        }
        try:
            self._store.set(f"{self.key_prefix}{self.rank}", json.dumps(value))
        except Exception as err:
            self.store_error = f"{type(err).__name__}: {err}"

    def _read(self, rank: int) -> RankRecord | None:
        key = f"{self.key_prefix}{rank}"
        if not self._store.check([key]):  # never a blocking get on a key that is not there
            return None
        value = json.loads(self._store.get(key))
        idle = float(value["idle_s"]) + max(0.0, time.time() - float(value["wall"]))
        return RankRecord(rank, int(value["step"]), str(value["phase"]), idle, value.get("kind"), value.get("where"))

    def _read_others(self, wait_for_where: float, stale_after: float) -> list[RankRecord] | None:
        """Every other rank's last record; waits up to ``wait_for_where`` seconds for the idle ranks to say where they
        wait. None when the store cannot be read."""
        if self._store is None:
            return None
        deadline = time.monotonic() + wait_for_where
        try:
            while True:
                records = [r for rank in range(self.world_size) if rank != self.rank and (r := self._read(rank))]
                pending = [r for r in records if r.where is None and r.idle_s > stale_after]
                if not pending or time.monotonic() >= deadline:
                    return records
                time.sleep(self.poll_s / 2)
        except Exception as err:
            self.store_error = f"{type(err).__name__}: {err}"
            return None

    def _unpublish(self) -> None:
        if self._store is None:
            return
        with contextlib.suppress(Exception):
            self._store.delete_key(f"{self.key_prefix}{self.rank}")
        self._store = None


def _wait_fields(wait: Wait | None) -> tuple[str | None, str | None]:
    return (None, None) if wait is None else (wait.kind, wait.text)


def say_now(text: str) -> None:
    """Write ``text`` to standard error at once (the job's log), bypassing warning filters and buffers."""
    with contextlib.suppress(OSError):
        os.write(2, (text.rstrip("\n") + "\n").encode("utf-8", "replace"))
