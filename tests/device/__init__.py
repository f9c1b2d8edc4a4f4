"""The hardware check (issue 31): one prepared script for a lent GPU machine.

``make device-check`` (``python3 -m tests.device.check``) runs in the repository root of a bare
machine with a CUDA GPU and many cores that has numpy, scipy, numba, numba-cuda, CuPy, pyarrow,
pytest and hypothesis but no Spark and no network. :mod:`tests.device.wheels` names what
terascale needs beyond that (``make device-wheels`` downloads it, with terascale's own wheel,
into ``.whl/`` here); :mod:`tests.device.check` installs those wheels without dependencies and
runs the steps of :mod:`tests.device.steps` in a fixed time budget, each writing one JSON file,
plus one log, into ``$OUT`` (else ``bench-results/device/``). ``--rehearsal`` runs the same
steps with tiny sizes under numba's CUDA simulator; ``make test`` does that
(tests/test_device_check.py), so the device finds a script that already works.
"""
