"""Binary classification metrics as a mergeable accumulator: add / merge / finalize.

Each scoring task adds its (probability, label, weight) batches; partial accumulators merge by
addition (merging an empty one changes nothing), so metrics over billions of rows need only
small per-task state. Log-loss, the base rate and calibration are exact sums. auROC and auPRC
come from weighted score histograms with ``BINS`` equal-width bins on the logit scale
(clipped to ±LOGIT_RANGE), so ties only arise within a bin and are counted half (trapezoid);
the error against an exact computation is far below the metrics' statistical noise.

- logloss = Σ w·(−y·log p − (1−y)·log(1−p)) / Σ w, with p clipped to [EPS, 1−EPS]
- normalized entropy = logloss / H(base rate), H(q) = −q·log q − (1−q)·log(1−q)
- calibration = (Σ w·p) / (Σ w·y): mean prediction over the positive rate
- auPRC = Σₖ (Rₖ − Rₖ₋₁)·Pₖ over thresholds from high to low (average precision)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

BINS = 1 << 16
LOGIT_RANGE = 20.0
EPS = 1e-15


def _bin_of(p: np.ndarray) -> np.ndarray:
    pc = np.clip(p.astype(np.float64), EPS, 1 - EPS)
    logit = np.log(pc) - np.log1p(-pc)
    b = np.floor((np.clip(logit, -LOGIT_RANGE, LOGIT_RANGE) + LOGIT_RANGE) / (2 * LOGIT_RANGE) * BINS)
    return np.minimum(b.astype(np.int64), BINS - 1)


@dataclass
class BinaryMetrics:
    pos_hist: np.ndarray = field(default_factory=lambda: np.zeros(BINS, np.float64))
    neg_hist: np.ndarray = field(default_factory=lambda: np.zeros(BINS, np.float64))
    loss_sum: float = 0.0
    weight_sum: float = 0.0
    pos_weight: float = 0.0
    pred_sum: float = 0.0
    rows: int = 0

    def add(self, probs: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> BinaryMetrics:
        p = np.asarray(probs, dtype=np.float64)
        y = np.asarray(labels, dtype=np.float64)
        w = np.ones_like(p) if weights is None else np.asarray(weights, dtype=np.float64)
        if not (np.all(np.isfinite(p)) and np.all((p >= 0) & (p <= 1))):
            raise ValueError("probabilities must be finite and in [0, 1]")
        pc = np.clip(p, EPS, 1 - EPS)
        self.loss_sum += float(np.sum(w * -(y * np.log(pc) + (1 - y) * np.log1p(-pc))))
        self.weight_sum += float(w.sum())
        self.pos_weight += float(np.sum(w * y))
        self.pred_sum += float(np.sum(w * p))
        self.rows += int(p.shape[0])
        b = _bin_of(p)
        self.pos_hist += np.bincount(b, weights=w * y, minlength=BINS)
        self.neg_hist += np.bincount(b, weights=w * (1 - y), minlength=BINS)
        return self

    def merge(self, other: BinaryMetrics) -> BinaryMetrics:
        self.pos_hist += other.pos_hist
        self.neg_hist += other.neg_hist
        self.loss_sum += other.loss_sum
        self.weight_sum += other.weight_sum
        self.pos_weight += other.pos_weight
        self.pred_sum += other.pred_sum
        self.rows += other.rows
        return self

    def finalize(self) -> dict:
        if self.weight_sum <= 0:
            raise ValueError("no rows to evaluate")
        rate = self.pos_weight / self.weight_sum
        logloss = self.loss_sum / self.weight_sum
        ent = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)) if 0 < rate < 1 else float("nan")
        # thresholds from the highest bin down
        tp = np.cumsum(self.pos_hist[::-1])
        fp = np.cumsum(self.neg_hist[::-1])
        P, N = tp[-1], fp[-1]
        if P > 0 and N > 0:
            tpr = np.concatenate([[0.0], tp / P])
            fpr = np.concatenate([[0.0], fp / N])
            auroc = float(np.sum((fpr[1:] - fpr[:-1]) * (tpr[1:] + tpr[:-1]) / 2))
            nz = (tp + fp) > 0
            prec = np.where(nz, tp / np.where(nz, tp + fp, 1.0), 1.0)
            rec = tp / P
            auprc = float(np.sum(np.diff(np.concatenate([[0.0], rec])) * prec))
        else:
            auroc = auprc = float("nan")
        curves = self._curves(tp, fp, P, N) if P > 0 and N > 0 else None
        return {
            "curves": curves,
            "rows": self.rows,
            "weight_sum": self.weight_sum,
            "logloss": logloss,
            "auroc": auroc,
            "auprc": auprc,
            "normalized_entropy": logloss / ent if ent == ent and ent > 0 else float("nan"),
            "positive_rate": rate,
            "mean_prediction": self.pred_sum / self.weight_sum,
            "calibration": (self.pred_sum / self.pos_weight) if self.pos_weight > 0 else float("nan"),
        }

    def _curves(self, tp: np.ndarray, fp: np.ndarray, P: float, N: float, points: int = 200,
                calibration_bins: int = 20) -> dict:
        """ROC and precision-recall points (thresholds from high to low) and a calibration
        table (equal-weight groups of score bins: mean prediction vs observed positive rate)."""
        idx = np.unique(np.linspace(0, len(tp) - 1, points).astype(np.int64))
        nz = (tp + fp)[idx] > 0
        roc = {"fpr": [0.0, *(fp[idx] / N).tolist()], "tpr": [0.0, *(tp[idx] / P).tolist()]}
        pr = {"recall": (tp[idx][nz] / P).tolist(), "precision": (tp[idx][nz] / (tp[idx] + fp[idx])[nz]).tolist()}
        # calibration: bins ordered by score, grouped into equal-weight groups
        w = self.pos_hist + self.neg_hist
        centers = 1.0 / (1.0 + np.exp(-((np.arange(BINS) + 0.5) / BINS * 2 * LOGIT_RANGE - LOGIT_RANGE)))
        cum = np.cumsum(w)
        group = np.minimum((cum / cum[-1] * calibration_bins).astype(np.int64), calibration_bins - 1)
        ws = np.bincount(group, weights=w, minlength=calibration_bins)
        pred = np.bincount(group, weights=w * centers, minlength=calibration_bins)
        pos = np.bincount(group, weights=self.pos_hist, minlength=calibration_bins)
        ok = ws > 0
        calib = {"mean_prediction": (pred[ok] / ws[ok]).tolist(), "positive_rate": (pos[ok] / ws[ok]).tolist(),
                 "weight": ws[ok].tolist()}
        return {"roc": roc, "pr": pr, "calibration": calib}

    def to_state(self) -> dict:
        """A compact, picklable state for shipping from a task to the driver."""
        nzp, nzn = np.flatnonzero(self.pos_hist), np.flatnonzero(self.neg_hist)
        return {"pos": (nzp, self.pos_hist[nzp]), "neg": (nzn, self.neg_hist[nzn]),
                "sums": (self.loss_sum, self.weight_sum, self.pos_weight, self.pred_sum, self.rows)}

    @classmethod
    def from_state(cls, s: dict) -> BinaryMetrics:
        m = cls()
        m.pos_hist[s["pos"][0]] = s["pos"][1]
        m.neg_hist[s["neg"][0]] = s["neg"][1]
        m.loss_sum, m.weight_sum, m.pos_weight, m.pred_sum, m.rows = s["sums"]
        return m
