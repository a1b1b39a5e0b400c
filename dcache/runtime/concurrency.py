"""One generation at a time per hooked transformer: concurrent generations are refused, never mixed.

A handle keeps one generation record, one set of branch caches and one schedule state per transformer, so two
threads generating with one hooked transformer (two pipelines built from the same components, or one pipeline
called from two threads) would read each other's caches and decisions. `GenerationGuard` keeps them apart:

  * a transformer call while another thread's call is running is refused (`ConcurrentGenerationError`);
  * a pipeline generation belongs to the thread that started it (its scheduler's `set_timesteps`, or its first
    transformer call). Another thread that starts a generation while it is open takes the transformer over: the
    open generation ends there, and its thread's next transformer call or scheduler step is refused. So the later
    request runs to a correct image and the earlier one stops with an error that says why, instead of both getting
    images made of each other's caches. A generation abandoned half-way (an exception in a step callback) is taken
    over the same way, so it never blocks the transformer;
  * transformer-only use (`dcache.apply(transformer, ...)`, a custom loop): a call from another thread may start a
    new generation (its timestep is back at the start) but never continue one that another thread owns.

The bookkeeping runs under one lock (an uncontended acquire per call and per scheduler event); a refused call is
refused before it changes any state, so the generation it would have disturbed goes on unharmed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..generations.records import GenerationRecord

_FIX = ("dcache serves one generation at a time per transformer. To serve requests in parallel threads, give each "
        "thread its own transformer (copy.deepcopy(pipe.transformer), then dcache.apply to that pipeline), or "
        "serialise the pipeline calls with a threading.Lock.")


class ConcurrentGenerationError(RuntimeError):
    """A transformer call or scheduler event from a thread whose generation could not run alongside another's."""


def _me() -> tuple[int, str]:
    """(ident, name) of the calling thread: names are kept because a thread may be gone when an error names it."""
    thread = threading.current_thread()
    return threading.get_ident(), thread.name


class GenerationGuard:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.in_flight: tuple[int, str] | None = None  # (ident, name) of the thread whose transformer call runs now
        self._mine = threading.local()  # .record: the generation record this thread works on

    def __deepcopy__(self, memo: dict) -> "GenerationGuard":
        """A deep copy of a hooked model (copy.deepcopy(pipe)) gets a fresh guard: no thread is inside the copy's
        calls, and locks and thread-local state cannot be copied."""
        return GenerationGuard()

    # -- transformer calls -------------------------------------------------------------------------------------
    def enter_call(self) -> None:
        """Mark a transformer call of this thread as running; refused while another thread's call runs."""
        me = _me()
        if self.in_flight is not None and self.in_flight[0] != me[0]:
            raise ConcurrentGenerationError(
                f"a transformer call from thread {me[1]!r} arrived while thread {self.in_flight[1]!r} is inside a "
                f"call of the same dcache-hooked transformer; the call is refused so that the running generation "
                f"stays correct. {_FIX}")
        self.in_flight = me

    def exit_call(self) -> None:
        if self.in_flight is not None and self.in_flight[0] == threading.get_ident():
            self.in_flight = None

    # -- generations -------------------------------------------------------------------------------------------
    def own(self, record: GenerationRecord) -> None:
        """This thread started `record`."""
        record.owner = _me()
        self._mine.record = record

    def check_not_taken(self) -> None:
        """Refuse when this thread's open generation was taken over by another thread's (it ended there)."""
        record = getattr(self._mine, "record", None)
        if record is None or record.taken_by is None:
            return
        self._mine.record = None  # the refusal is said once: this thread's next generation starts afresh
        raise ConcurrentGenerationError(
            f"this generation (thread {record.owner[1]!r}, stopped at step {record.step}) was ended when "
            f"thread {record.taken_by[1]!r} started a generation on the same dcache-hooked transformer; "
            f"continuing would mix the two requests' caches. {_FIX}")

    def other_owner(self, record: GenerationRecord | None) -> tuple[int, str] | None:
        """The thread that owns `record` when it is open and not this thread's; else None."""
        if record is None or record.finished or record.owner is None:
            return None
        return None if record.owner[0] == threading.get_ident() else record.owner

    def take_over(self, record: GenerationRecord | None) -> None:
        """This thread starts a generation while `record` (another thread's, open) runs: it ends there."""
        if self.other_owner(record) is not None:
            record.taken_by = _me()

    def refuse_foreign(self, record: GenerationRecord | None, what: str) -> None:
        """Refuse `what` (a transformer call, a scheduler step) of this thread in `record`, another thread's open
        generation that this thread cannot take over."""
        owner = self.other_owner(record)
        if owner is not None:
            raise ConcurrentGenerationError(
                f"{what} from thread {_me()[1]!r} would continue the generation of thread {owner[1]!r} (step "
                f"{record.step}) on the same dcache-hooked transformer. {_FIX}")


__all__ = ["ConcurrentGenerationError", "GenerationGuard"]
