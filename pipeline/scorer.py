"""Score raw log lines with a model directory, without Spark or a JVM.

The feature spec in the model's ``metadata.json`` is the public contract. Criteo lines go
through one fused kernel (``pipeline.score_kernel``) built from featurize's own line helpers
(validation, tokens, hashing) that sums each row's margin with the predict job's operations in
its order, without writing CSR rows; LibSVM lines through featurize's parser
(``pipeline.blocks.BlockParser``) and the predict job's margins. Either way the probabilities
come from the predict job's formula (``solvers.predict.sigmoid``), so a line scores to the same
float64 bits here as its row does in ``predict``.

Lines are in the format the model was featurized from (``spec.format``): Criteo TSV (label, 13
integer fields, 26 categorical fields) or LibSVM (``label idx:val ...``); for a table model
(``featurize.format = table``) JSON lines, one object per record with the table's column names
(``pipeline.table_records``; the featurize kernel hashes them, any label is ignored). The label must be
valid (it is parsed as in featurize) but is not used for scoring. Serving logs without the
label (``labeled=False``): the scorer puts a label 0 in front of every line (``0\t`` or ``0 ``)
before parsing, so such a line scores exactly as the labeled line would (a line within two
bytes of ``max_line_bytes`` may then count as too long).

A malformed line (a line featurize would quarantine: bad label, wrong field count, bad integer,
empty, too long) is an error naming its 1-based line number and reason
(:class:`MalformedLine`); with ``skip_bad`` its probability is NaN instead.

Probabilities (``calibration``, the ``predict.calibration`` key; ``pipeline.sampling``), the
predict job's: ``population`` is σ(a·margin + c) with the slope and shift the model fitted on its
held-out rows (``train.recalibrate``; σ(margin) for a model without), ``sampled`` is
σ(a·margin + c − ln r) for a model trained on negatives kept at rate r and weighted 1/r (the
click rate among the kept rows), ``raw`` is σ(margin).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from terascale.pipeline import modeldir
from terascale.pipeline.blocks import BlockParser
from terascale.pipeline.pointer import resolve_model
from terascale.pipeline.rowkernels import REASONS, UNPARSABLE
from terascale.pipeline.sampling import model_negative_rate, score_transform
from terascale.pipeline.score_kernel import score_criteo_block
from terascale.pipeline.spec import FeatureSpec
from terascale.pipeline.table_kernel import featurize_batch
from terascale.pipeline.table_records import parse_json_lines, records_batch
from terascale.solvers.catalogue import loss_spec
from terascale.solvers.data import CSRData
from terascale.solvers.predict import decision_function, sigmoid


class MalformedLine(ValueError):
    """A line the featurize kernels reject; ``line`` is 1-based, ``reason`` featurize's reason."""

    def __init__(self, line: int, reason: str):
        self.line, self.reason = line, reason
        super().__init__(f"line {line}: malformed ({reason}); featurize would quarantine it")


class Scorer:
    """A model's weights, intercept and feature spec, ready to score raw lines.

    A Scorer reuses its parser's buffers between calls: use one per thread (they can share
    nothing but the read-only weights).
    """

    def __init__(self, weights: np.ndarray, intercept: float, meta: dict, calibration: str = "population",
                 labeled: bool = True):
        self.weights = weights
        self.intercept = float(intercept)
        self.meta = meta
        self.spec = FeatureSpec.from_json(meta["spec"])
        self.loss = meta["config"]["train"]["loss"]
        self.negative_rate = model_negative_rate(meta)
        self.calibration = calibration
        self.slope, self.logit_shift = score_transform(meta, calibration)  # σ(slope·m + logit_shift)
        max_line = int(meta["config"].get("featurize", {}).get("max_line_bytes", 65536))
        self._table = self.spec.format == "table"
        self._parser = None if self._table else BlockParser(self.spec, max_line)
        self._n_features = 1 << self.spec.bits
        self._sigmoid = loss_spec(self.loss).link == "sigmoid"
        self._fused = self.spec.format == "criteo"
        if self._fused:  # the fused kernel reads the weights as they are: float32, C-contiguous
            if self.weights.shape != (self._n_features,):
                raise ValueError(f"weights have shape {self.weights.shape}, the spec {self._n_features} features")
            self._coef = np.ascontiguousarray(self.weights, dtype=np.float32)
            self._seps = np.zeros(0, np.int64)
            self._status = np.zeros(0, np.int8)
            self._margins = np.zeros(0, np.float64)
        self._prefix = b"" if labeled or self._table else (b"0\t" if self.spec.format == "criteo" else b"0 ")

    @classmethod
    def from_model_dir(cls, path: str, calibration: str = "population", labeled: bool = True) -> Scorer:
        """Load a model directory (or a pointer file naming one, ``terascale publish``)."""
        w, b, meta = modeldir.load_model(resolve_model(path))
        return cls(w, b, meta, calibration, labeled)

    @property
    def column(self) -> str:
        return "probability" if loss_spec(self.loss).link == "sigmoid" else "score"

    def predict_block(self, data: bytes | np.ndarray, skip_bad: bool = False, first_line: int = 1) -> np.ndarray:
        """Scores (float64) of every line in ``data`` (whole lines, ``\\n``-separated; a last
        line without ``\\n`` counts). ``first_line``: the number of the block's first line in
        error messages."""
        if self._table:
            lines = bytes(data).split(b"\n")
            if lines and lines[-1] == b"":
                lines.pop()
            records, bad = parse_json_lines(lines)
            return self.predict_records(records, skip_bad, first_line, bad)
        if self._prefix:
            data = _with_labels(bytes(data), self._prefix)
        buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
        if buf.shape[0] == 0:
            return np.zeros(0, np.float64)
        if self._fused:
            status, m = self._score_criteo(buf)
        else:
            pb = self._parser.parse(buf)
            status, m = pb.status, None
        bad = status != 0
        any_bad = bool(bad.any())
        if any_bad and not skip_bad:
            i = int(np.flatnonzero(bad)[0])
            raise MalformedLine(first_line + i, REASONS[int(status[i])])
        if m is None:
            n = pb.labels.shape[0]
            csr = CSRData(pb.indptr, pb.indices, pb.values, pb.labels, np.ones(n, np.float32), self._n_features)
            m = decision_function(csr, self.weights, self.intercept)
        elif any_bad:
            m = m[~bad]
        if self._sigmoid:
            scores = sigmoid(m, self.logit_shift, self.slope)
        else:
            scores = m.copy() if self._fused and not any_bad else m  # (not the kernel's buffer)
        if not any_bad:
            return scores
        out = np.full(status.shape[0], np.nan)
        out[~bad] = scores
        return out

    def predict_records(self, records: Sequence[Mapping], skip_bad: bool = False, first_line: int = 1,
                        bad: np.ndarray | None = None) -> np.ndarray:
        """Scores of records of a table model (mappings of column -> value, see
        ``pipeline.table_records``); a record featurize would quarantine raises MalformedLine
        naming it (1-based from ``first_line``), or scores NaN with ``skip_bad``. Any label in
        a record is ignored."""
        if not records:
            return np.zeros(0, np.float64)
        batch, unreadable = records_batch(self.spec.table, records)
        if bad is not None:
            unreadable |= bad
        rows = featurize_batch(self.spec.table, self.spec.bits, self.spec.seed, batch)
        status = rows.status.copy()
        status[unreadable] = UNPARSABLE
        bad_rows = status != 0
        if bad_rows.any() and not skip_bad:
            i = int(np.flatnonzero(bad_rows)[0])
            raise MalformedLine(first_line + i, REASONS[int(status[i])])
        good = np.flatnonzero(rows.status == 0)
        keep = ~unreadable[good]  # rows of the kernel's output that stay
        n = int(good.shape[0])
        csr = CSRData(rows.indptr, rows.indices, rows.values, rows.labels, np.ones(n, np.float32), self._n_features)
        m = decision_function(csr, self.weights, self.intercept)[keep]
        scores = sigmoid(m, self.logit_shift, self.slope) if self._sigmoid else m
        out = np.full(status.shape[0], np.nan)
        out[~bad_rows] = scores
        return out

    def _score_criteo(self, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(status, margin) of every line of a Criteo block (``pipeline.score_kernel``); the
        margins of bad lines are 0. Views of the kernel's buffers when one call did the block:
        valid until the next block."""
        n_bytes = buf.shape[0]
        if self._seps.shape[0] < n_bytes + 1:
            self._seps = np.zeros(n_bytes + 1, np.int64)  # lazily zeroed: pages are touched only as used
        cap = max(self._status.shape[0], n_bytes // 64 + 16)
        if self._status.shape[0] < cap:
            self._status, self._margins = np.zeros(cap, np.int8), np.zeros(cap, np.float64)
        pr, parts, p = self._parser, [], 0
        while p < n_bytes:
            n, p = score_criteo_block(
                buf, n_bytes, p, pr.max_line, pr.sel, pr.int_mode, pr.conj, pr.pdata, pr.poff, pr.pword, pr.mask,
                self.spec.seed, pr.int_table, self._seps, pr.scratch, self._coef, self.intercept, self._status,
                self._margins)
            parts.append((self._status[:n], self._margins[:n]))
            if p < n_bytes:
                parts[-1] = (parts[-1][0].copy(), parts[-1][1].copy())
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts])

    def predict_lines(self, lines: Iterable[str | bytes], skip_bad: bool = False) -> np.ndarray:
        """Scores (float64) of ``lines`` (str or bytes, one line each, a trailing newline allowed)."""
        enc = []
        for k, line in enumerate(lines, 1):
            b = line.encode("utf-8") if isinstance(line, str) else bytes(line)
            if b.endswith(b"\n"):
                b = b[:-1]
            if b"\n" in b:
                raise MalformedLine(k, "newline inside the line")
            enc.append(b)
        if not enc:
            return np.zeros(0, np.float64)
        return self.predict_block(b"\n".join(enc) + b"\n", skip_bad)


def _with_labels(data: bytes, prefix: bytes) -> bytes:
    """Every line of ``data`` with ``prefix`` in front (a last newline starts no new line)."""
    if not data:
        return data
    out = prefix + data.replace(b"\n", b"\n" + prefix)
    return out[: -len(prefix)] if data.endswith(b"\n") else out
