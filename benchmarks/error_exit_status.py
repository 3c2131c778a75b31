"""How often does a 2-rank script that fails end a rank by a signal? Run it N times and count.

    python benchmarks/error_exit_status.py --runs 30                    # bucketddp
    python benchmarks/error_exit_status.py --runs 30 --wrapper ddp      # torch DDP
    python benchmarks/error_exit_status.py --runs 30 --scenario unused  # error in backward

The runs and their scenarios are in ``tools/error_exits.py``, which the test suite uses for
a few runs.
"""

from __future__ import annotations

import os
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

from error_exits import main

if __name__ == "__main__":
    main()
