"""A numba cache that survives Spark applications.

numba's own cache locators key a kernel's cache directory on the absolute path of its source
file. On a cluster terascale's code arrives per application (``--py-files`` zip, or an
``--archives`` environment unpacked into the application's work directory), so every path is
new, every executor of every application recompiles every kernel, and stale caches pile up.
:class:`StableLocator` keys the cache on the module's import name instead
(``terascale.pipeline.hashing`` -> ``<root>/terascale/pipeline/hashing``) and on one hash of the
sources of every module of terascale's kernel packages (pipeline, solvers), read through the package's resources
(files or zip archives alike): the same code finds the same cache in the next application on
that node, and any change to them misses it. A package-wide hash, not the module's own:
numba compiles the kernels a kernel calls into its cached code (``criteo_kernel`` embeds
``hashing.murmur3_32``), so a change to a callee must invalidate its callers too.

Enable it in a process before numba compiles anything (spark-submit jobs set it for their
executors, see ``jobs.session``)::

    NUMBA_CACHE_LOCATOR_CLASSES=terascale.pipeline.numba_cache.StableLocator,InTreeCacheLocator,UserWideCacheLocator,ZipCacheLocator
    NUMBA_CACHE_DIR=/local/disk/numba-cache   # optional; default ~/.cache/terascale/numba

The other names keep numba's usual locators as fall-backs (e.g. when the cache root is not
writable). No pyspark here.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import os

from numba.core.caching import _CacheLocator

LOCATORS = "terascale.pipeline.numba_cache.StableLocator,InTreeCacheLocator,UserWideCacheLocator,ZipCacheLocator"
DEFAULT_ROOT = os.path.join("~", ".cache", "terascale", "numba")


def cache_root() -> str:
    return os.path.expanduser(os.environ.get("NUMBA_CACHE_DIR") or DEFAULT_ROOT)


@functools.cache
def package_digest(top: str) -> str | None:
    """sha256 over the relative path and bytes of every .py file of package ``top``."""
    try:
        root = importlib.resources.files(top)
    except (ModuleNotFoundError, TypeError):
        return None
    h = hashlib.sha256()
    stack = [("", root)]
    while stack:
        prefix, node = stack.pop()
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            rel = f"{prefix}/{child.name}"
            if child.is_dir():
                if child.name != "__pycache__":
                    stack.append((rel, child))
            elif child.name.endswith(".py"):
                h.update(rel.encode() + b"\0" + child.read_bytes() + b"\0")
    return h.hexdigest()


#: the packages that hold numba kernels: a kernel may call njit code of either (the scorer in
#: pipeline runs the solvers' prediction kernels), so the stamp covers both; allreduce and jobs
#: hold none (tests/test_numba_cache.py checks), so editing them keeps the compiled kernels.
PACKAGES = ("terascale.pipeline", "terascale.solvers")


def kernel_digest(module_name: str) -> str | None:
    """The stamp of a module: the kernel packages (:data:`PACKAGES`) for terascale's modules,
    else its top package."""
    if module_name.startswith("terascale."):
        parts = [package_digest(p) for p in PACKAGES]
        if None in parts:
            return None
        return hashlib.sha256("".join(parts).encode()).hexdigest()
    return package_digest(module_name.split(".")[0])


class StableLocator(_CacheLocator):
    """Cache directory by module name, freshness by source content (see the module docstring)."""

    def __init__(self, py_func, module_name: str, stamp: str) -> None:
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = os.path.join(cache_root(), *module_name.split("."))
        self._stamp = stamp

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> str:
        return self._stamp

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        name = getattr(py_func, "__module__", None) or ""
        if "." not in name:  # scripts and top-level modules: numba's own locators
            return None
        try:
            stamp = kernel_digest(name)
        except OSError:
            return None
        if stamp is None:
            return None
        self = cls(py_func, name, stamp)
        try:
            self.ensure_cache_path()
        except OSError:
            return None  # not writable: numba's own locators take over
        return self
