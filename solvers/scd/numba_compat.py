"""Keep numba-cuda working with the NumPy it is installed beside.

numba-cuda (0.30 and earlier) registers an overload for ``np.row_stack`` the first time it
compiles a kernel; NumPy 2.5 removed that alias of ``np.vstack`` (deprecated since NumPy 2.0),
so the first kernel launch fails with ``AttributeError: module 'numpy' has no attribute
'row_stack'`` (seen on the GPU machine: numpy 2.5.2, numba-cuda 0.30.4). Importing this module
before ``numba.cuda`` compiles anything restores the alias when it is missing; it is exactly
``np.vstack``, and nothing is changed where NumPy still has it.
"""

from __future__ import annotations

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
