"""Register bucketddp's strategy names with Lightning, without importing Lightning.

``import bucketddp`` must stay cheap for plain PyTorch programs and must work where Lightning
is not installed, yet ``Trainer(strategy="bucket_ddp")`` and ``Fabric(strategy="bucket_ddp")``
must work whichever package the user imports first. ``install()`` registers the names now
with each Lightning package already imported, and puts a finder on ``sys.meta_path`` that
registers them with the others right after they are imported.

The finder lives in the top-level module ``_bucketddp_startup``, outside this package,
because the wheel also installs it when the interpreter starts (``bucketddp-strategy-names.pth``),
where importing ``bucketddp`` (and torch) would cost every Python program its start-up time;
see that module. This module imports nothing from Lightning.
"""

from __future__ import annotations

from _bucketddp_startup import install

__all__ = ["install"]
