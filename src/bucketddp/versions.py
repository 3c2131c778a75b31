"""The releases bucketddp is tested with, and a warning for any release outside them.

The package metadata states floors only (``torch>=2.5``, ``lightning>=2.4``), so that pip
never refuses or downgrades a newer torch or Lightning for bucketddp's sake. The tested
window lives here and in docs/compatibility.md: outside it, bucketddp warns once per
package, at import, and goes on. Imports neither torch nor Lightning.
"""

from __future__ import annotations

import re
import warnings

TESTED = {"torch": ("2.5", "2.15"), "lightning": ("2.4", "2.6")}
"""Each package's oldest and newest tested minor release (docs/compatibility.md)."""


class UntestedVersionWarning(UserWarning):
    """A torch or Lightning release newer than the newest bucketddp is tested with.

    Silence it with ``warnings.filterwarnings("ignore", category=UntestedVersionWarning)``
    or ``PYTHONWARNINGS="ignore::bucketddp.versions.UntestedVersionWarning"``.
    """


def _minor(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def warn_if_untested(package: str, version: str) -> None:
    """Warn when ``version`` of ``package`` is newer than the newest tested minor release.

    Older releases are not warned about here: the floors in the metadata (and
    ``_compat.check_torch``) keep them out.
    """
    newest = TESTED[package][1]
    if _minor(version) > _minor(newest):
        warnings.warn(
            f"bucketddp is tested with {package} {TESTED[package][0]} to {newest}; this is "
            f"{package} {version}. It will most likely work; if it does not, please report "
            "it, and pin an older release meanwhile (docs/compatibility.md).",
            UntestedVersionWarning,
            stacklevel=3,
        )
