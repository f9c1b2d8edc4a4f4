"""The quality gate between evaluate and publish: does the new model regress?

Compares one metric, lower is better (``logloss`` or ``normalized_entropy``), of the candidate's
evaluation (``terascale evaluate --out``) with the baseline's. The baseline is the published
model's pointer (its metrics, recorded by ``terascale publish --metrics``) or a metrics JSON file:

    allowed = baseline * (1 + max_regression)    margin 'relative' (the default)
    allowed = baseline + max_regression          margin 'absolute'

The gate passes when candidate <= allowed. When the baseline file does not exist (nothing has
been published yet: the first run) it passes and says so. Unreadable metrics, a missing or
non-finite metric, or a published pointer that recorded no metrics fail the gate: it never passes
a model it could not check.
"""

from __future__ import annotations

import math

from terascale.pipeline import fsutil
from terascale.pipeline.pointer import POINTER_FORMAT

METRICS = ("logloss", "normalized_entropy")
MARGINS = ("relative", "absolute")


class GateFailed(RuntimeError):
    """The candidate regressed, or its metrics could not be checked (exit code 1)."""


def read_json(path: str, what: str) -> dict:
    if not fsutil.exists(path):
        raise GateFailed(f"{what} {path}: no such file")
    try:
        obj = fsutil.read_json(path)
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise GateFailed(f"{what} {path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise GateFailed(f"{what} {path}: want a JSON object, found {type(obj).__name__}")
    return obj


def metric_value(metrics: dict, metric: str, where: str) -> float:
    v = metrics.get(metric)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise GateFailed(f"{where}: no finite {metric!r} (found {v!r})")
    return float(v)


def baseline(path: str, metric: str) -> tuple[float, str] | None:
    """(value, description) of the baseline, or None when there is none yet."""
    if not fsutil.exists(path):
        return None
    obj = read_json(path, "baseline")
    if obj.get("pointer_format") == POINTER_FORMAT:  # the published model's pointer
        if not isinstance(obj.get("metrics"), dict):
            raise GateFailed(f"baseline pointer {path}: the published model {obj.get('model')} has no recorded "
                             "metrics (it was published without --metrics); re-publish it with --metrics "
                             "or give --baseline a metrics file")
        return metric_value(obj["metrics"], metric, f"baseline pointer {path}"), f"published model {obj['model']}"
    return metric_value(obj, metric, f"baseline {path}"), f"baseline {path}"


def run_gate(metrics_path: str, baseline_path: str, metric: str = "logloss",
             max_regression: float = 0.01, margin: str = "relative") -> str:
    """The verdict as one line; raises GateFailed when the candidate does not pass."""
    new = metric_value(read_json(metrics_path, "metrics"), metric, f"metrics {metrics_path}")
    base = baseline(baseline_path, metric)
    if base is None:
        return (f"gate passed: no baseline at {baseline_path} (nothing published yet), so the first "
                f"model passes unchecked; its {metric} is {new:.6f}")
    value, what = base
    if margin == "relative":
        allowed, rule = value * (1.0 + max_regression), f"+{max_regression:.2%} relative"
    else:
        allowed, rule = value + max_regression, f"+{max_regression:g} absolute"
    detail = f"{what}: {value:.6f}, margin {rule}"
    if new > allowed:
        raise GateFailed(f"{metric} regressed: {new:.6f} > {allowed:.6f} allowed ({detail}); not publishing")
    return f"gate passed: {metric} {new:.6f} <= {allowed:.6f} allowed ({detail})"
