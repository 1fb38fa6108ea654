"""mosaic-streaming's MDS codec (encodings, compression, hashing) without its package ``__init__``.

``import streaming`` (and any ``streaming.base...`` import, which runs the package ``__init__`` files
first) imports torch, transformers and torchvision: ~4.5 s and ~850 MB in every Ray worker that reads
or writes MDS. The three modules the pipeline needs import only numpy, PIL and the compression/hash
libraries, so they are loaded here under their real names with their parent packages stubbed for the
duration of the import. If ``streaming`` is already imported (a user's process), that is used as is.

Everything MDS-specific the pipeline writes or reads goes through mosaic's own functions
(``mds_encode``/``mds_decode``, ``compress``/``decompress``, ``get_hash``), so the bytes are mosaic's;
only the few lines that lay samples out in a shard (``pipelines.mds.reader``, ``pipelines.mds.writer``)
follow mosaic's ``MDSWriter``/``MDSReader`` by hand, and tests read our shards with mosaic's own reader.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
from typing import Any

__all__ = ["compression", "encodings", "hashing"]

_PACKAGES = ("streaming", "streaming.base", "streaming.base.format", "streaming.base.format.mds")
_lock = threading.Lock()


def _import_without_package_init(name: str) -> Any:
    """Import module ``name`` (e.g. ``streaming.base.compression``) without running its packages' ``__init__``."""
    if name in sys.modules:
        return sys.modules[name]
    if "streaming" in sys.modules:  # the real package is already loaded: nothing to save
        return importlib.import_module(name)
    spec = importlib.util.find_spec("streaming")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mosaicml-streaming is not installed (pip install mosaicml-streaming)")
    root = list(spec.submodule_search_locations)[0]
    stubs = []
    try:
        for pkg in _PACKAGES:
            if pkg in sys.modules:
                continue
            path = os.path.join(root, *pkg.split(".")[1:])
            stub = types.ModuleType(pkg)
            stub.__path__ = [path]
            stub.__spec__ = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
            stub.__spec__.submodule_search_locations = [path]
            sys.modules[pkg] = stub
            stubs.append(pkg)
        return importlib.import_module(name)
    finally:
        for pkg in stubs:  # a later ``import streaming`` gets the real package (and reuses these modules)
            sys.modules.pop(pkg, None)


with _lock:
    compression = _import_without_package_init("streaming.base.compression")
    hashing = _import_without_package_init("streaming.base.hashing")
    encodings = _import_without_package_init("streaming.base.format.mds.encodings")
