"""The optional libraries a source needs, checked when the source is opened: present, and new enough.

An old backend fails in ways that look like something else (s3fs 0.4.2 raised ``TypeError`` for an
argument it did not know, which a retry loop then took for a network fault); a missing one raises
``ImportError`` deep in a call. Both become one :class:`MissingDependencyError` here, naming the
library, the version found and the version needed, before any request is made.
"""

from __future__ import annotations

import importlib.metadata
import re

from weightstream.errors import MissingDependencyError

MINIMUM_VERSIONS = {
    "botocore": "1.34.0",
    "fsspec": "2024.6.0",
    "gcsfs": "2024.6.0",
    "adlfs": "2024.4.1",
    "azure-storage-blob": "12.19.0",
}
"""The oldest release of each backend weightstream is tested with (the floors of the extras in pyproject.toml)."""
INSTALL_HINTS = {
    "s3": "pip install -U 'weightstream[s3]'",
    "gs": "pip install -U 'weightstream[gcs]'",
    "az": "pip install -U 'weightstream[azure]'",
}


def require(scheme: str, *distributions: str) -> None:
    """Raise :class:`MissingDependencyError` unless every one of ``distributions`` is installed at its
    minimum version or newer (``scheme`` names what needs them, for the message).

    Example:
        >>> require("s3", "botocore")  # doctest: +SKIP
    """
    for distribution in distributions:
        minimum = MINIMUM_VERSIONS[distribution]
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            raise MissingDependencyError(
                f"{scheme}:// needs {distribution}>={minimum}, which is not installed: {INSTALL_HINTS[scheme]}"
            ) from None
        if release(installed) < release(minimum):
            raise MissingDependencyError(
                f"{scheme}:// needs {distribution}>={minimum}; {distribution} {installed} is installed: "
                f"{INSTALL_HINTS[scheme]}"
            )


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2024.6.0"`` -> ``(2024, 6, 0)``, ``"1.2rc1"`` -> ``(1, 2)``.

    Example:
        >>> release("0.4.2") < release("2024.6.0")
        True
    """
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else (0,)
