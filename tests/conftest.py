"""The suite's rank processes start with torch._dynamo imported.

A process imports torch._dynamo the first time it builds an optimizer (torch.optim's
methods are wrapped to keep Dynamo out of them): one to several seconds of CPU per rank,
paid again in every launch of ``run_ranks``, about 200 in the suite. The forkserver the
ranks come from imports it once instead. The benchmarks leave it out, so that their ranks
stay as fresh as a user's; test_compile.py's check that eager training never imports it
starts its rank fresh (``run_ranks(..., fresh=True)``).
"""

from __future__ import annotations

import multirank

multirank.preload("torch._dynamo")
