"""What the vLLM and SGLang loader classes share: their settings from the engine's extra loader config, the model's
location resolved once per loader, the log line of a load's time, the class's name, and the warning for an engine
version never checked."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from weightstream.engines.common import loader_options, model_weights
from weightstream.errors import logger

log = logger(__name__)


class LoaderSettings:
    """One engine loader's weights location (``uri`` in the extra config, else the engine's model) and options,
    checked when the engine makes the loader, and the location once resolved.

    Example:
        >>> settings = LoaderSettings({"threads": 8}, "weightstream")
        >>> settings.located("/models/llama", None, None)
        ('/models/llama', {'threads': 8})
    """

    def __init__(self, extra: dict[str, Any] | None, load_format: str) -> None:
        self.uri, self.options = loader_options(extra, load_format)
        self._located: tuple[str, dict[str, Any]] | None = None

    def located(self, model: str, revision: str | None, download_dir: str | None) -> tuple[str, dict[str, Any]]:
        """Where the weights are and the options to read them with, resolved on the first call (a Hugging Face id:
        the cache, or the Hub's commit its revision names), the same on every later one."""
        if self._located is None:
            self._located = model_weights(self.uri or model, revision, download_dir, self.options)
        return self._located


def version_checked(engine: str, version: str, checked: tuple[str, ...], internals: str) -> bool:
    """Whether ``version`` of ``engine`` is one the adapter's uses of its ``internals`` were run on; a WARNING
    naming it when not (callers cache the answer: once a process).

    Example:
        >>> version_checked("SGLang", "0.5.23", ("0.5.23",), "its model loader's helpers")
        True
    """
    if version in checked:
        return True
    log.warning(
        "%s %s: weightstream's %s adapter was checked on %s %s; it uses %s internals (%s) that may differ in this "
        "version",
        engine,
        version,
        engine,
        engine,
        ", ".join(checked),
        engine,
        internals,
    )
    return False


@contextlib.contextmanager
def timed_load(info: Callable[..., None], weightstream_format: str) -> Iterator[None]:
    """Log, through the engine's logger's ``info``, how long the load inside took (only when it succeeded)."""
    started = time.perf_counter()
    yield
    info(
        "Loading weights took %.2f seconds (weightstream, format %s)",
        time.perf_counter() - started,
        weightstream_format,
    )


def named_for(loader_class: type, load_format: str) -> type:
    """``loader_class``, named after the load format it serves (``WeightstreamModelLoader_weightstream_layered``)."""
    loader_class.__name__ = loader_class.__qualname__ = "WeightstreamModelLoader_" + load_format.replace("-", "_")
    return loader_class
