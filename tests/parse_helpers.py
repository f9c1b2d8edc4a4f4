"""Run the block parsers on bytes in tests and return plain Python rows."""

from __future__ import annotations

import numpy as np

from terascale.pipeline.blocks import BlockParser
from terascale.pipeline.rowkernels import REASONS
from terascale.pipeline.spec import FeatureSpec


def parse_bytes(data: bytes, spec: FeatureSpec, max_line: int = 65536):
    """-> (rows [(label, indices, values)], reasons per line)."""
    pb = BlockParser(spec, max_line).parse(np.frombuffer(data, dtype=np.uint8))
    rows = []
    for r in range(pb.labels.shape[0]):
        a, b = pb.indptr[r], pb.indptr[r + 1]
        rows.append((float(pb.labels[r]), pb.indices[a:b].tolist(), pb.values[a:b].tolist()))
    return rows, [REASONS[s] for s in pb.status.tolist()]
