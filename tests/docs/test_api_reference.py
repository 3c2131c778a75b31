"""The built API reference documents every name in ``bucketddp.__all__``.

``python3 dev.py docs`` builds the site into docs/_build/html, then runs this file. In the
suite (``python3 dev.py test``) it checks the last build, and is skipped if there is none.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

import bucketddp

HTML = Path(__file__).resolve().parents[2] / "docs" / "_build" / "html"


def _inventory() -> dict[str, str]:
    """Sphinx's objects.inv: each documented Python object's full name and its page."""
    data = (HTML / "objects.inv").read_bytes()
    header = b"".join(data.splitlines(keepends=True)[:4])
    found = {}
    for line in zlib.decompress(data[len(header) :]).decode().splitlines():
        name, role, _priority, uri = line.split(" ", 4)[:4]
        if role.startswith("py:"):
            found[name] = uri.split("#")[0]
    return found


def test_every_public_name_is_in_the_api_reference() -> None:
    if not (HTML / "objects.inv").exists():
        pytest.skip("the docs are not built: python3 dev.py docs")
    documented = _inventory()
    page = (HTML / "api.html").read_text()
    missing = [
        name
        for name in bucketddp.__all__
        if documented.get(f"bucketddp.{name}") != "api.html" or f'id="bucketddp.{name}"' not in page
    ]
    assert not missing, f"not in docs/api.md: {missing}"


def test_the_wrappers_own_methods_are_in_the_api_reference() -> None:
    """Members a class takes from bucketddp's own bases (``join`` from ``JoinableWrapper``)
    are listed too, which ``:members:`` alone leaves out."""
    if not (HTML / "objects.inv").exists():
        pytest.skip("the docs are not built: python3 dev.py docs")
    page = (HTML / "api.html").read_text()
    cls = bucketddp.BucketDataParallel
    own = {
        name
        for base in cls.__mro__
        if base.__module__.startswith("bucketddp.")
        for name in vars(base)
        if not name.startswith("_")
    }
    missing = sorted(n for n in own if f'id="bucketddp.BucketDataParallel.{n}"' not in page)
    assert not missing, f"not in docs/api.md: {missing}"
