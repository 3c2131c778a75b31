"""Sphinx configuration for the bucketddp docs site: ``python3 dev.py docs``.

The pages are the Markdown files beside this one, read by MyST, so they stay readable on
GitHub; the API reference (api.md) is generated from the docstrings by autodoc.
"""

from __future__ import annotations

import inspect
import re
import zlib
from pathlib import Path
from typing import Any

from sphinx.util import logging

import bucketddp
from bucketddp.options import EngineOptions

project = "bucketddp"
release = version = bucketddp.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
]
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
html_static_path = ["_static"]
# Figures open full size on a click; wide tables scroll instead of being clipped.
html_css_files = ["bucketddp.css"]
html_js_files = ["bucketddp.js"]
html_show_copyright = False

# Links into torch's and Lightning's docs, with no network at build time: the inventories
# are written from the short lists below (the names our pages and docstrings use), not
# fetched. A name not listed is left as plain text, as before.
_INVENTORIES = {
    "torch": (
        "https://docs.pytorch.org/docs/stable/",
        {
            "torch.nn.parallel.DistributedDataParallel": (
                "class",
                "generated/torch.nn.parallel.DistributedDataParallel.html",
            ),
            "torch.nn.Module": ("class", "generated/torch.nn.Module.html"),
            # The names autodoc gives the types in signatures.
            "torch.nn.modules.module.Module": ("class", "generated/torch.nn.Module.html"),
            "torch.nn.parallel.distributed.DistributedDataParallel": (
                "class",
                "generated/torch.nn.parallel.DistributedDataParallel.html",
            ),
            "torch.nn.SyncBatchNorm": ("class", "generated/torch.nn.SyncBatchNorm.html"),
            "torch.Tensor": ("class", "tensors.html#torch.Tensor"),
            "torch.distributed.ProcessGroup": ("class", "distributed.html"),
            "torch.distributed.device_mesh.DeviceMesh": (
                "class",
                "distributed.html#torch.distributed.device_mesh.DeviceMesh",
            ),
        },
    ),
    "lightning": (
        "https://lightning.ai/docs/pytorch/stable/",
        {
            "lightning.pytorch.strategies.DDPStrategy": (
                "class",
                "api/lightning.pytorch.strategies.DDPStrategy.html",
            ),
            "lightning.pytorch.Trainer": ("class", "common/trainer.html"),
            "lightning.pytorch.LightningModule": ("class", "common/lightning_module.html"),
            "lightning.pytorch.callbacks.Callback": (
                "class",
                "api/lightning.pytorch.callbacks.Callback.html",
            ),
        },
    ),
    "fabric": (
        "https://lightning.ai/docs/fabric/stable/",
        {
            "lightning.fabric.Fabric": ("class", "api/fabric_methods.html"),
            "lightning.fabric.strategies.DDPStrategy": (
                "class",
                "api/generated/lightning.fabric.strategies.DDPStrategy.html",
            ),
        },
    ),
}
_INVENTORY_DIR = Path(__file__).parent / "_build" / "inventories"


def _write_inventory(name: str, entries: dict[str, tuple[str, str]]) -> str:
    """Sphinx's objects.inv (version 2) for ``entries``; returns its path."""
    body = "".join(f"{obj} py:{role} 1 {uri} -\n" for obj, (role, uri) in entries.items())
    header = f"# Sphinx inventory version 2\n# Project: {name}\n# Version: \n"
    header += "# The remainder of this file is compressed using zlib.\n"
    _INVENTORY_DIR.mkdir(parents=True, exist_ok=True)
    path = _INVENTORY_DIR / f"{name}.inv"
    path.write_bytes(header.encode() + zlib.compress(body.encode()))
    return str(path)


intersphinx_mapping = {
    name: (url, _write_inventory(name, entries)) for name, (url, entries) in _INVENTORIES.items()
}

# Every constructor argument of these classes is documented in the reference, or the build
# fails: in the class's "Args:", or as a field of EngineOptions (which has its own entry).
_CHECKED = {
    "bucketddp.BucketDataParallel",
    "bucketddp.BucketDDP",
    "bucketddp.BucketFabricDDP",
    "bucketddp.options.EngineOptions",
}
_ENGINE_FIELDS = [f for f in EngineOptions.__dataclass_fields__ if f != "unused_hint"]
_log = logging.getLogger("bucketddp.docs")


def _check_arguments(
    app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Fail the build on a constructor argument the reference does not document.

    Runs after napoleon, so "Args:" entries are ``:param name:`` lines by now. An engine
    option the class does not describe itself gets a line pointing at its EngineOptions
    field, which must be documented there.
    """
    if what != "class" or name not in _CHECKED:
        return
    text = "\n".join(lines)
    if name == "bucketddp.options.EngineOptions":
        for field in _ENGINE_FIELDS:
            if f".. attribute:: {field}" not in text:
                _log.warning(f"docs: EngineOptions field {field!r} is not in its Attributes")
        return
    for arg in inspect.signature(obj).parameters:
        if arg == "module" or re.search(rf"^:param {arg}:", text, flags=re.M):
            continue
        if arg in _ENGINE_FIELDS:
            lines.append(
                f":param {arg}: an engine option: "
                f":attr:`EngineOptions.{arg} <bucketddp.options.EngineOptions.{arg}>`."
            )
            continue
        _log.warning(f"docs: {name} takes {arg!r}, which its docstring does not document")


_DOC_MENTION = re.compile(r"``docs/([\w-]+)\.md(#[\w-]+)?``|docs/([\w-]+)\.md(#[\w-]+)?")


# Literal names in docstrings that become links into torch's and Lightning's docs.
_EXTERNAL = {
    "torch.nn.parallel.DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "nn.Module": "torch.nn.Module",
    "DeviceMesh": "torch.distributed.device_mesh.DeviceMesh",
    "torch.nn.SyncBatchNorm": "torch.nn.SyncBatchNorm",
}
_LITERAL = re.compile(r"``([\w.]+)``")


def _link_mentions(
    app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Make the docstrings' mentions of docs/<page>.md links to the page, and the names
    of torch's and Lightning's classes links into their docs."""
    strategy = "lightning.fabric" if "Fabric" in name else "lightning.pytorch"
    targets = {**_EXTERNAL, "DDPStrategy": f"{strategy}.strategies.DDPStrategy"}

    def external(m: re.Match[str]) -> str:
        target = targets.get(m[1])
        return f":class:`{m[1]} <{target}>`" if target else m[0]

    for i, line in enumerate(lines):
        line = _DOC_MENTION.sub(lambda m: f":doc:`{m[1] or m[3]}`", line)
        lines[i] = _LITERAL.sub(external, line)


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
    app.connect("autodoc-process-docstring", _link_mentions, priority=650)
    app.connect("autodoc-process-docstring", _check_arguments, priority=700)
