"""What the front ends and the array core need of a session, and what a session needs of a
step being captured: the contracts that keep the client core apart from the sessions under
it."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Recorder"]


class Recorder(Protocol):
    """A step being captured (``gpuremote.core.recording``), as a session sees it: a call
    that waits for the device, or sends host data, cannot be part of it."""

    def refuse(self, what: str) -> None:
        """``what`` cannot be part of the step: raise ``CaptureError``, or end the recording
        (a step made with ``fallback``) and let the call go ahead."""
        ...
