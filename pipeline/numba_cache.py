"""A numba cache that survives Spark applications.

numba's own cache locators key a kernel's cache directory on the absolute path of its source
file. On a cluster terascale's code arrives per application (``--py-files`` zip, or an
``--archives`` environment unpacked into the application's work directory), so every path is
new, every executor of every application recompiles every kernel (tens of seconds of CPU per
executor), and stale caches pile up. :class:`StableLocator` keys the cache on the module's
import name instead (``pipeline.hashing`` -> ``<root>/pipeline/hashing``) and on a hash of the
module's source, read through its loader (files or zip archives alike): the same code finds the
same cache in the next application on that node, and changed code misses it.

Enable it in a process before numba compiles anything (spark-submit jobs set it for their
executors, see ``jobs.session``)::

    NUMBA_CACHE_LOCATOR_CLASSES=pipeline.numba_cache.StableLocator,InTreeCacheLocator,UserWideCacheLocator,ZipCacheLocator
    NUMBA_CACHE_DIR=/local/disk/numba-cache   # optional; default ~/.cache/terascale/numba

The other names keep numba's usual locators as fall-backs (e.g. when the cache root is not
writable). No pyspark here.
"""

from __future__ import annotations

import hashlib
import os
import sys

from numba.core.caching import _CacheLocator

LOCATORS = "pipeline.numba_cache.StableLocator,InTreeCacheLocator,UserWideCacheLocator,ZipCacheLocator"
DEFAULT_ROOT = os.path.join("~", ".cache", "terascale", "numba")


def cache_root() -> str:
    return os.path.expanduser(os.environ.get("NUMBA_CACHE_DIR") or DEFAULT_ROOT)


def _source(module) -> bytes | None:
    loader = getattr(module, "__loader__", None)
    path = getattr(module, "__file__", None)
    if loader is None or path is None or not hasattr(loader, "get_data"):
        return None
    try:
        return loader.get_data(path)
    except OSError:
        return None


class StableLocator(_CacheLocator):
    """Cache directory by module name, freshness by source content (see the module docstring)."""

    def __init__(self, py_func, module_name: str, source: bytes) -> None:
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = os.path.join(cache_root(), *module_name.split("."))
        self._stamp = hashlib.sha256(source).hexdigest()

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> str:
        return self._stamp

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        name = getattr(py_func, "__module__", None)
        module = sys.modules.get(name or "")
        if module is None or name == "__main__":
            return None
        source = _source(module)
        if source is None:
            return None
        self = cls(py_func, name, source)
        try:
            self.ensure_cache_path()
        except OSError:
            return None  # not writable: numba's own locators take over
        return self
