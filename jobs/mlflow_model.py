"""terascale's MLflow model: a pyfunc model that scores raw log lines as ``terascale score`` does.

The logged model (``jobs.tracking`` logs it with ``tracking.log_model``) carries the model
directory as its artifact ``model_dir`` and no pickled object: its code is this module, loaded by
MLflow from ``jobs/mlflow_pyfunc.py`` ("models from code"), so loading it needs terascale
installed (with the mlflow extra) where it is served.

``mlflow.pyfunc.load_model(uri).predict(x)`` returns one float64 score per row of ``x`` (the
probability for a logistic model, the margin otherwise), computed by the raw-line scorer
(``pipeline.scorer.Scorer.predict_lines``, the code path of ``terascale score``), so a line scores
to the same bits here, in ``terascale score`` and in the predict job. ``x`` is one of

- raw lines in the model's format (Criteo TSV or LibSVM): a string, a list, array or Series of
  strings or bytes, a DataFrame with a ``line`` column (or a single column), or ``{"line": [...]}``
  (what ``mlflow models serve`` hands over for ``{"inputs": ...}`` and ``{"dataframe_split": ...}``);
- a table model's records (``featurize.format = table``): a DataFrame with the table's columns
  (pandas' missing values are nulls; ``pipeline.table_records``), or JSON lines as raw lines;
- Criteo fields (a Criteo model only): a DataFrame whose columns are among ``label``, ``I1``..``I13``,
  ``C1``..``C26``; a missing column or a missing value (None, NaN) is an empty field, integral floats
  (pandas' integers with gaps) are written as integers, and a missing ``label`` column scores every
  row as a line with label 0 (the label is checked but does not change the score).

The model's configuration (``model_config``, at logging or at ``load_model(uri, model_config=...)``):
``calibration`` (``predict.calibration``: population, sampled or raw; default population),
``labeled`` (raw lines begin with the label, as ``terascale score``; false = serving logs without
it, ``terascale score --no-label``; default true), ``skip_bad`` (a malformed line scores NaN
instead of raising ``pipeline.scorer.MalformedLine``, ``terascale score --skip-bad``; default false).

A scorer keeps parse buffers between calls, so each thread that predicts (a serving worker's
request threads) gets its own; they share the read-only weights.
"""

from __future__ import annotations

import math
import threading

import mlflow.pyfunc
import numpy as np

from terascale.jobs.config import CRITEO_FIELDS
from terascale.pipeline import modeldir
from terascale.pipeline.sampling import CALIBRATIONS
from terascale.pipeline.scorer import Scorer

ARTIFACT = "model_dir"  # the model directory inside the logged model's artifacts
LINE = "line"  # the column of raw lines
LABEL = "label"
CONFIG_DEFAULTS = {"calibration": "population", "labeled": True, "skip_bad": False}


class RawLineModel(mlflow.pyfunc.PythonModel):
    """The pyfunc model of a terascale model directory (see the module docstring)."""

    # MLflow validates and converts predict's input by its type hints, and asks for them when a
    # subclass has none; this model takes raw lines and DataFrames of fields alike (lines())
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        conf = {**CONFIG_DEFAULTS, **(context.model_config or {})}
        unknown = sorted(set(conf) - set(CONFIG_DEFAULTS))
        if unknown:
            raise ValueError(f"model_config {unknown}: unknown; allowed: {sorted(CONFIG_DEFAULTS)}")
        if conf["calibration"] not in CALIBRATIONS:
            raise ValueError(f"model_config calibration = {conf['calibration']!r}: must be one of {list(CALIBRATIONS)}")
        self.calibration = str(conf["calibration"])
        self.labeled, self.skip_bad = bool(conf["labeled"]), bool(conf["skip_bad"])
        self.weights, self.intercept, self.meta = modeldir.load_model(context.artifacts[ARTIFACT])
        self.format = self.meta["spec"]["format"]
        self._local = threading.local()

    def _scorer(self, labeled: bool) -> Scorer:
        cache = self._local.__dict__.setdefault("scorers", {})
        if labeled not in cache:
            cache[labeled] = Scorer(self.weights, self.intercept, self.meta, self.calibration, labeled)
        return cache[labeled]

    def predict(self, context, model_input, params=None) -> np.ndarray:
        if self.format == "table" and not self._has_lines(model_input):
            from terascale.pipeline.table_records import frame_records

            return self._scorer(True).predict_records(frame_records(model_input), self.skip_bad)
        lines, labeled = self.lines(model_input)
        return self._scorer(labeled).predict_lines(lines, self.skip_bad)

    @staticmethod
    def _has_lines(x) -> bool:
        """Whether a table model's input is JSON lines rather than a DataFrame of the table's columns."""
        import pandas as pd

        return not isinstance(x, pd.DataFrame) or LINE in [str(c) for c in x.columns]

    def lines(self, x) -> tuple[list, bool]:
        """(raw lines, whether they begin with a label) of one input (see the module docstring)."""
        import pandas as pd

        if isinstance(x, (str, bytes)):
            return [x], self.labeled
        if isinstance(x, dict):
            if set(x) != {LINE}:
                raise ValueError(f"a mapping input must be {{{LINE!r}: [lines]}}, got keys {sorted(map(str, x))}")
            x = x[LINE]
            return ([x] if isinstance(x, (str, bytes)) else list(x)), self.labeled
        if isinstance(x, pd.DataFrame):
            columns = [str(c) for c in x.columns]
            if LINE in columns:
                return x[LINE].tolist(), self.labeled
            if (len(columns) == 1 and not set(columns) & {LABEL, *CRITEO_FIELDS}
                    and (pd.api.types.is_object_dtype(x.dtypes.iloc[0]) or pd.api.types.is_string_dtype(x.dtypes.iloc[0]))):
                return x.iloc[:, 0].tolist(), self.labeled  # an unnamed column of lines ({"inputs": [...]})
            return self._field_lines(x, columns), True
        if isinstance(x, pd.Series):
            return x.tolist(), self.labeled
        if isinstance(x, (list, tuple, np.ndarray)):
            return list(np.asarray(x, dtype=object).reshape(-1)) if isinstance(x, np.ndarray) else list(x), self.labeled
        raise TypeError(f"cannot score a {type(x).__name__}: give raw lines or a DataFrame of Criteo fields")

    def _field_lines(self, df, columns: list[str]) -> list[str]:
        """Criteo TSV lines (label first) of a DataFrame of fields."""
        if self.format != "criteo":
            raise ValueError(f"a DataFrame of fields needs a Criteo model; this model reads {self.format} lines: "
                             f"give a {LINE!r} column of raw lines")
        allowed = (LABEL, *CRITEO_FIELDS)
        unknown = [c for c in columns if c not in allowed]
        if unknown:
            raise ValueError(f"columns {unknown} are neither {LINE!r} (raw lines) nor Criteo fields ({LABEL}, I1..I13, "
                             "C1..C26)")
        n = len(df)
        cols = [[_field(v) for v in df[c].tolist()] if c in columns else ([""] * n if c != LABEL else ["0"] * n)
                for c in allowed]
        return ["\t".join(row) for row in zip(*cols, strict=True)] if n else []


def _field(v) -> str:
    """One field of a Criteo line: '' for a missing value, integral floats as integers."""
    if v is None:
        return ""
    if isinstance(v, float | np.floating):
        if math.isnan(v):
            return ""
        if float(v).is_integer():
            return str(int(v))
        return repr(float(v))
    if isinstance(v, bytes):
        return v.decode("utf-8")
    return str(v)
