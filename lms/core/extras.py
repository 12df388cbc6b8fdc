"""Optional packages and the extra of ``large-model-support`` that installs each."""

from __future__ import annotations

import importlib.util

from lms.core.errors import LMSError

__all__ = ["EXTRAS", "MissingExtraError", "installed", "require"]

EXTRAS = {
    "torchvision": "zoo",
    "monai": "zoo",
    "matplotlib": "plot",
    "lightning": "lightning",
    "transformers": "transformers",
    "scipy": "solver",
}
"""The extra that installs each optional package."""


class MissingExtraError(LMSError, ImportError):
    """An optional package that the asked-for work needs is not installed."""


def installed(package: str) -> bool:
    """Whether ``package`` can be imported here (without importing it)."""
    return importlib.util.find_spec(package) is not None


def require(package: str, *, for_what: str) -> None:
    """Refuse, before any work, what needs ``package`` where it is not installed.

    Raises:
        MissingExtraError: naming ``for_what``, the package and the extra to install.
    """
    if not installed(package):
        extra = EXTRAS.get(package)
        fix = f"pip install 'large-model-support[{extra}]'" if extra else f"pip install {package}"
        raise MissingExtraError(f"lms: {for_what} needs {package}, which is not installed; {fix}")
