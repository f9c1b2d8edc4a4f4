"""Solvers: numeric kernels (numba) and solver drivers over an abstract Communicator.

Layers (imports only go down; nothing here imports Spark):

- ``solvers.kernels``: losses, the online pass, loss/gradient/Hessian-diagonal sums, vector
  reductions; arrays and scalars only.
- below the drivers, with the kernels, free of the ``Communicator``: ``data`` (``CSRData``, the
  CSR container), ``shard``, ``predict`` (scoring), ``errors``. ``pipeline`` uses this layer of
  ``solvers`` and nothing above it (``tests/test_layers.py``).
- drivers: ``online`` (online passes + weighted averaging), ``lbfgs``, ``hybrid``; shared
  ``objective``, ``tracker`` (history, timings, held-out loss, early stopping), ``setup``
  (input agreement), ``state`` (checkpoints), ``catalogue`` (the registered losses and solvers).
- ``solvers.api.train`` is the entry point; ``solvers.params.SolverParams`` the parameters.
"""
