"""The spark-submit entry points: one thin ``main(argv)`` script per job.

Each file is run by ``spark-submit`` as a script (its docstring has the exact line); each only
parses its arguments through :mod:`terascale.jobs.cli` and calls the library in
:mod:`terascale.jobs`. ``make dist`` copies them to ``dist/jobs/``.
"""
