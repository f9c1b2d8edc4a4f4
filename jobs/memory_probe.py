"""A train task's measured memory: its process baseline, its peak RSS and the peak of each phase.

Linux reports a process's resident set (``VmRSS``) and its high-water mark (``VmHWM``) in
``/proc/self/status``; writing ``5`` to ``/proc/self/clear_refs`` (Linux ≥ 4.0) resets the
high-water mark to the current RSS, so each phase's peak is measured on its own, and a reused
Spark Python worker does not report an earlier task's peak. Where the reset is refused, a phase's
"peak" is the high-water mark when it ends (the peak so far; ``hwm_reset`` is False), and without
``/proc`` (macOS) ``ru_maxrss`` stands in for the high-water mark and the RSS alike.

The first phase starts at the baseline (its peak is at least that); the task's peak is the
largest of its phase peaks. Every figure is bytes.
"""

from __future__ import annotations

import sys

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes ({} without /proc)."""
    out = {}
    try:
        with open(_STATUS) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    num, _, unit = rest.strip().partition(" ")
                    out[key] = int(num) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError):
        return {}
    return out


def _maxrss() -> int:
    """ru_maxrss in bytes (KiB on Linux, bytes on macOS); 0 where there is none."""
    try:
        import resource

        v = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    except (ImportError, OSError, ValueError):
        return 0
    return v if sys.platform == "darwin" else v * 1024


def rss_bytes() -> int:
    """This process's resident set now (ru_maxrss without /proc)."""
    return _status().get("VmRSS") or _maxrss()


def hwm_bytes() -> int:
    """This process's resident high-water mark (since the last reset; ru_maxrss without /proc)."""
    return _status().get("VmHWM") or _maxrss()


def reset_hwm() -> bool:
    """Reset the high-water mark to the current RSS; False where the kernel refuses."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class MemoryProbe:
    """Measures one task: ``baseline`` when made, then :meth:`end_phase` after each phase."""

    def __init__(self) -> None:
        self.baseline = rss_bytes()
        self.hwm_reset = reset_hwm()
        self.phase_peaks: dict[str, int] = {}

    def end_phase(self, name: str) -> int:
        """Record the peak of the phase that ends now (module docstring); returns it."""
        floor = self.baseline if not self.phase_peaks else 0  # the first phase starts at the baseline
        peak = self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), hwm_bytes(), floor)
        if self.hwm_reset:
            self.hwm_reset = reset_hwm()
        return peak

    @property
    def peak(self) -> int:
        """The largest resident set of the task: the largest phase peak (the high-water mark so
        far while no phase has ended)."""
        return max(self.phase_peaks.values()) if self.phase_peaks else max(self.baseline, hwm_bytes())
