"""Resume a two-"node" BucketDDP run from a checkpoint that only node 0 has.

    python examples/two_node_resume.py

Two processes play two machines with local disks only: each runs in a directory of its own
(``node0/`` and ``node1/`` under a temporary folder), and they meet over loopback, started
the way a cluster's launcher starts them (``NODE_RANK``, ``MASTER_ADDR``, ...). Rank 0
writes the checkpoints under the relative path ``checkpoints/``, so they exist in
``node0/`` alone. The second run resumes with ``ckpt_path="checkpoints/step=4.ckpt"``:
rank 0 reads the file and sends it to rank 1, which has no such file. The resumed weights
are then compared with those of the run that never stopped.

The checkpoint falls at the end of an epoch (4 steps per epoch here), so a plain
DataLoader resumes exactly; for mid-epoch checkpoints use a stateful loader, such as
torchdata's ``StatefulDataLoader`` (see docs/strategy.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

NODES = 2


def train(resume: bool) -> None:
    """One node's part: 8 steps straight with checkpoints, or 4 more from step 4."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from bucketddp import BucketDDP

    torch.set_num_threads(1)
    pl.seed_everything(0)  # the same seed when resuming: the sampler shuffles by it
    model = BoringModel()
    saving = ModelCheckpoint(dirpath="checkpoints", every_n_train_steps=4, save_top_k=-1)
    trainer = pl.Trainer(
        strategy=BucketDDP(),
        accelerator="cpu",
        num_nodes=NODES,
        devices=1,
        max_steps=8,
        limit_train_batches=4,  # epochs of 4 steps: the checkpoint at step 4 ends one
        limit_val_batches=0,
        callbacks=[saving],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, ckpt_path="checkpoints/epoch=0-step=4.ckpt" if resume else None)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), "resumed.pt" if resume else "straight.pt")


def launch(base: Path, resume: bool) -> None:
    """Start one process per node, each in its own directory, and wait for both."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
        "WORLD_SIZE": str(NODES),
        "LOCAL_RANK": "0",
        # This checkout's bucketddp (the node directories are elsewhere).
        "PYTHONPATH": os.pathsep.join(
            filter(
                None, [str(Path(__file__).resolve().parents[1] / "src"), os.getenv("PYTHONPATH")]
            )
        ),
    }
    command = [sys.executable, str(Path(__file__).resolve()), "--node"]
    command.append("resume" if resume else "train")
    procs = [
        subprocess.Popen(command, cwd=base / f"node{n}", env={**env, "NODE_RANK": str(n)})
        for n in range(NODES)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("a node failed")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        for n in range(NODES):
            (base / f"node{n}").mkdir()
        launch(base, resume=False)
        print("node0:", sorted(p.name for p in (base / "node0" / "checkpoints").iterdir()))
        print("node1 has checkpoints:", (base / "node1" / "checkpoints").exists())
        launch(base, resume=True)
        straight = torch.load(base / "node0" / "straight.pt")
        resumed = torch.load(base / "node0" / "resumed.pt")
        same = all(torch.equal(straight[k], resumed[k]) for k in straight)
        print("resumed weights equal the uninterrupted run's, bit for bit:", same)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--node"]:
        train(resume=sys.argv[2] == "resume")
    else:
        main()
