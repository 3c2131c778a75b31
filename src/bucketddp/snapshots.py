"""``python -m bucketddp.snapshots list | remove RUN... | remove --all``: the elastic
snapshots this user's jobs left on this node (``bucketddp.elastic.leftovers``;
docs/elastic.md, "What is left in /dev/shm")."""

from __future__ import annotations

import sys

from .elastic.leftovers import main

if __name__ == "__main__":
    sys.exit(main())
