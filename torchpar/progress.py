"""A progress bar over the compile phases (capture, plan, XLA compile) that can take minutes on large models.

Shown on an interactive terminal only (tqdm's ``disable=None``: nothing is written when stderr is not a TTY,
as in CI logs); ``TORCHPAR_PROGRESS=0`` turns it off, ``=1`` forces it on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm


class CompilePhases:
    """``with phases.phase("capture"): ...`` advances one bar whose label names the running phase."""

    def __init__(self, names: Sequence[str], what: str):
        setting = os.environ.get("TORCHPAR_PROGRESS", "")
        disable = None if setting == "" else setting == "0"
        self._bar = tqdm(total=len(names), desc=f"torchpar: compiling {what}", unit="phase", leave=False,
                         disable=disable)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._bar.set_postfix_str(name, refresh=True)
        yield
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
