"""Sphinx configuration for the bucketddp docs site: ``python3 dev.py docs``.

The pages are the Markdown files beside this one, read by MyST, so they stay readable on
GitHub; the API reference (api.md) is generated from the docstrings by autodoc.
"""

from __future__ import annotations

from typing import Any

import bucketddp

project = "bucketddp"
release = version = bucketddp.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# pypi.md is the package page (pyproject.toml's readme), not a page of the site.
exclude_patterns = ["_build", "pypi.md"]

# GitHub's anchors, so that a link such as strategy.md#options works on GitHub and here.
myst_heading_anchors = 6

# The docstrings are Google style ("Args:", "Returns:", "Raises:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"

html_theme = "furo"
html_title = f"bucketddp {release}"
html_static_path: list[str] = []
html_show_copyright = False


def _link_changelog(app: Any, docname: str, source: list[str]) -> None:
    """Point links to ../CHANGELOG.md (right on GitHub) at the site's changelog page."""
    source[0] = source[0].replace("](../CHANGELOG.md", "](changelog.md")


# Napoleon reads an attribute's or property's first line as "type: description", and the
# docstrings here are prose ("The exposed wait: time spent ..."); their type comes from the
# annotation. So they skip napoleon: saved before it runs (priority 500), restored after.
_prose: dict[str, list[str]] = {}


def _save_prose(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    if what in ("attribute", "property", "data"):
        _prose[name] = list(lines)


def _restore_prose(
    app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    if name in _prose:
        lines[:] = _prose.pop(name)


def setup(app: Any) -> None:
    """Register this file's hooks with Sphinx."""
    app.connect("source-read", _link_changelog)
    app.connect("autodoc-process-docstring", _save_prose, priority=400)
    app.connect("autodoc-process-docstring", _restore_prose, priority=600)
