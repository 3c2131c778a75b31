"""The suite's rank processes start with torch._dynamo imported.

A process imports torch._dynamo the first time it builds an optimizer (torch.optim's
methods are wrapped to keep Dynamo out of them): one to several seconds of CPU per rank,
paid again in nearly every launch of ``run_ranks``. The forkserver the ranks come from
imports it once instead (``MULTIRANK_PRELOAD``, read when multirank is
imported: set here, before any test module imports it). The benchmark runs the suite starts
inherit it; run by hand, the benchmarks leave it out, so their ranks stay as fresh as a
user's. test_compile.py's check that eager training never imports torch._dynamo starts its
rank fresh (``run_ranks(..., fresh=True)``).
"""

from __future__ import annotations

import os

os.environ["MULTIRANK_PRELOAD"] = "torch._dynamo"
