"""What a long command shows while it works: a line per stage, and tqdm bars (with ETA) unless --no-progress.

    progress = Progress(enabled=True)          # --progress (default); Progress(enabled=False): --no-progress
    progress.stage("loading the model")         # "[dcache] loading the model" on stderr, in both modes
    with progress.bar(total=8, desc="generate", unit="run") as bar:
        for run in runs:
            ...
            bar.step("cached 1/3")             # advances the bar and shows the name; a no-op without bars

Lines and bars go to stderr, so stdout keeps only the command's result (a summary, a table).
`Progress(quiet=True)` prints nothing at all: the Python API's default.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator


class _Bar:
    """A tqdm bar, or nothing (enabled=False)."""

    def __init__(self, bar: Any | None):
        self._bar = bar

    def step(self, name: str | None = None, n: int = 1) -> None:
        if self._bar is not None:
            if name:
                self._bar.set_postfix_str(name, refresh=False)
            if self._bar.total is not None and self._bar.n + n > self._bar.total:
                self._bar.total = self._bar.n + n  # work beyond the estimate (a calibrator running a job again)
            self._bar.update(n)

    def set_postfix(self, **values: Any) -> None:
        if self._bar is not None:
            self._bar.set_postfix(**values)


class Progress:
    def __init__(self, enabled: bool = True, quiet: bool = False):
        self.enabled = enabled and not quiet
        self.quiet = quiet

    def stage(self, text: str) -> None:
        """One line naming what starts now (kept with and without bars)."""
        if self.quiet:
            return
        if self.enabled:
            from tqdm.auto import tqdm

            tqdm.write(f"[dcache] {text}", file=sys.stderr)  # above any open bar
        else:
            print(f"[dcache] {text}", file=sys.stderr, flush=True)

    def runs(self, what: str) -> bool | Callable[[str], None]:
        """What a callee that counts its own runs takes as `progress=`: True (draw its bar), a function printing
        one stage line per run (--no-progress), or False (quiet)."""
        if self.quiet:
            return False
        return True if self.enabled else (lambda line: self.stage(f"{what}: {line}"))

    @contextmanager
    def bar(self, total: int | None, desc: str, unit: str = "it") -> Iterator[_Bar]:
        """total None: a counter (count, rate and elapsed time, no ETA) for work of unknown size."""
        if not self.enabled:
            yield _Bar(None)
            return
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr)
        try:
            yield _Bar(bar)
        finally:
            bar.close()


__all__ = ["Progress"]
