#!/usr/bin/env python3
"""A seeded differential fuzzer for the Lightning strategy: ``BucketDDP`` against ``"ddp"``.

Each *schedule* is a pure function of one integer seed (``random.Random(seed)``): a small
LightningModule (BatchNorm, a layer used twice, a layer some ranks skip at some steps, a
layer no rank runs), automatic or manual optimization, the Trainer's options
(``max_steps``, ``accumulate_grad_batches``, ``gradient_clip_val``, ``precision``) and the
options both strategies take (``bucket_cap_mb``, ``find_unused_parameters``,
``static_graph``, ``gradient_as_bucket_view``, a communication hook), and whether the fit
stops at a step, saves a checkpoint (``Trainer.save_checkpoint``) and goes on in a new
Trainer from it (``fit(ckpt_path=...)``), the module built anew from other weights. Two CPU
ranks fit the module once with Lightning's ``DDPStrategy`` and once with ``BucketDDP``, from
the same seed, through Lightning's own launcher; every rank's parameters and buffers after
the (last) fit must agree with the other strategy's on that rank (to ``ATOL``), and across
the ranks. A quarter of the schedules run on three CPU ranks instead of two. Buffers
are compared with rank 0's under "ddp": BucketDDP syncs them once more at the end of fit.

Only combinations torch DDP runs are generated: ``find_unused_parameters=True`` whenever a
layer goes unused on some rank (``static_graph`` covers the layer no rank runs), no
``static_graph`` beside the rank-dependent layer, in manual optimization or with gradient
accumulation (torch DDP fails an internal assert there), and, in manual optimization, no
``accumulate_grad_batches`` or ``gradient_clip_val`` (Lightning refuses them there): it
accumulates with ``toggle_model(sync_grad=...)`` instead. "ddp" gets the communication hook
from a callback, since Lightning registers ``ddp_comm_hook`` only on CUDA.

Usage (``python3 dev.py fuzz-lightning ...`` runs it in the project's venv)::

    .venv/bin/python tools/fuzz_lightning.py --schedules 40 --seed 0
    .venv/bin/python tools/fuzz_lightning.py --replay 17    # one schedule, described

Schedules run ``--group`` at a time in one launch of two processes (Lightning's start-up
is most of the time); a launch that fails names its seeds, to replay one by one.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ATOL = 1e-6
IN, OUT = 6, 3


@dataclass(frozen=True)
class LightningSchedule:
    """Everything one fit pair does, generated from ``seed`` by ``make_schedule``."""

    seed: int
    width: int
    bn: bool
    twice: bool
    """A layer applied twice in the forward (one parameter, two uses)."""
    branch: bool
    """A layer rank ``r`` runs only at batches where ``batch_idx + r`` is even."""
    spare: bool
    """A layer no rank ever runs."""
    manual: bool
    adam: bool
    max_steps: int
    accumulate: int
    clip: float | None
    precision: str
    batch_size: int
    hook: str | None
    """``"allreduce"`` or ``"fp16"`` (torch's default hooks), or None."""
    options: dict[str, Any]
    """The keyword arguments both ``DDPStrategy`` and ``BucketDDP`` get."""
    resume_at: int | None = None
    """Stop the first fit after this many steps, save a checkpoint, and resume from it."""
    world: int = 2
    """How many CPU ranks fit it (``devices``)."""

    def short(self) -> str:
        """A one-line summary: model | strategy options | training loop."""
        blocks = [f"w{self.world} x{self.width}"]
        blocks += [n for n in ("bn", "twice", "branch", "spare") if getattr(self, n)]
        o = self.options
        engine = [
            f"cap={o['bucket_cap_mb']:g}",
            f"view={'T' if o['gradient_as_bucket_view'] else 'F'}",
        ]
        engine += [
            n for n, k in (("unused", "find_unused_parameters"), ("static", "static_graph")) if o[k]
        ]
        if self.hook:
            engine.append(self.hook)
        loop = ["manual" if self.manual else "auto", "adam" if self.adam else "sgd"]
        loop += [f"steps={self.max_steps}", f"acc={self.accumulate}", self.precision]
        if self.clip is not None:
            loop.append(f"clip={self.clip:g}")
        if self.resume_at is not None:
            loop.append(f"resume@{self.resume_at}")
        return f"{'+'.join(blocks)} | {' '.join(engine)} | {' '.join(loop)}"


def make_schedule(seed: int) -> LightningSchedule:
    """The schedule of ``seed``: only combinations both strategies run."""
    rng = random.Random(seed)
    bn, twice, branch, spare = (rng.random() < p for p in (0.4, 0.3, 0.4, 0.25))
    manual = rng.random() < 0.3
    accumulate = rng.choice([1, 1, 2, 3])
    # torch DDP's static graph fails an internal assert (reducer.cpp, expect_autograd_hooks_)
    # when the first steps run without sync, under Lightning's gradient accumulation or
    # manual optimization's toggle_model: no reference there.
    static = not branch and not manual and accumulate == 1 and rng.random() < 0.3
    # Later features draw from streams of their own, so that every earlier draw of a seed
    # stays what it was.
    world = 3 if random.Random(f"{seed}/world").random() < 0.25 else 2
    options = {
        "bucket_cap_mb": rng.choice([25.0, 0.001, 0.0002]),
        "find_unused_parameters": branch or (spare and not static) or rng.random() < 0.2,
        "static_graph": static,
        "gradient_as_bucket_view": rng.random() < 0.5,
    }
    drawn = LightningSchedule(
        seed=seed,
        width=rng.choice([4, 8, 12]),
        bn=bn,
        twice=twice,
        branch=branch,
        spare=spare,
        manual=manual,
        adam=rng.random() < 0.4,
        max_steps=rng.randint(2, 4),
        accumulate=accumulate,
        clip=None if manual or rng.random() < 0.6 else rng.choice([0.05, 1.0]),
        precision=rng.choice(["32-true", "32-true", "bf16-mixed"]),
        batch_size=rng.randint(3, 5),
        hook=rng.choice([None, None, "allreduce", "fp16"]),
        options=options,
        world=world,
    )
    resume = random.Random(f"{seed}/resume")
    if resume.random() < 0.35:
        drawn = replace(drawn, resume_at=resume.randint(1, drawn.max_steps - 1))
    if world > 2 and drawn.hook == "fp16":
        # torch DDP's first step reduces one bucket in registration order, bucketddp its
        # planned buckets in reverse order. At three ranks or more, gloo adds the three fp16
        # values of an element in an order that depends on the element's place in the
        # bucket, so the first step's average can differ by an fp16 rounding step: a
        # difference of that size hides real ones, and a tolerance for it would too.
        return replace(drawn, hook="allreduce")
    return drawn


def _module(s: LightningSchedule) -> Any:
    """The schedule's LightningModule (Lightning is imported in the rank processes only)."""
    import lightning.pytorch as pl

    class FuzzModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            w = s.width
            self.automatic_optimization = not s.manual
            # No bias in front of BatchNorm (as usual): its gradient would be rounding noise
            # around zero, which Adam turns into full-size steps of either sign. At three
            # ranks the strategies' sums of it differ in the last bit (gloo adds in another
            # order, see make_schedule), and so would the bias by a whole step.
            self.inp = nn.Linear(IN, w, bias=not s.bn)
            self.bn = nn.BatchNorm1d(w) if s.bn else None
            self.mid = nn.Linear(w, w)
            self.branch = nn.Linear(w, w) if s.branch else None
            self.spare = nn.Linear(w, w) if s.spare else None
            self.head = nn.Linear(w, OUT)

        def forward(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            h = self.inp(x)
            if self.bn is not None:
                h = self.bn(h)
            h = torch.tanh(self.mid(torch.tanh(h)))
            if s.twice:
                h = torch.tanh(self.mid(h))
            if self.branch is not None and (batch_idx + self.global_rank) % 2 == 0:
                h = h + torch.tanh(self.branch(h))
            return self.head(h)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.mse_loss(self(x, batch_idx), y)
            if not s.manual:
                return loss
            opt = self.optimizers()
            step = (batch_idx + 1) % s.accumulate == 0
            with opt.toggle_model(sync_grad=step):  # type: ignore[union-attr]
                self.manual_backward(loss / s.accumulate)
                if step:
                    opt.step()  # type: ignore[union-attr]
                    opt.zero_grad()  # type: ignore[union-attr]
            return None

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if s.adam:
                return torch.optim.Adam(self.parameters(), lr=0.02)
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self) -> DataLoader[Any]:
            g = torch.Generator().manual_seed(s.seed)
            rows = s.world * s.batch_size * 12
            data = TensorDataset(
                torch.randn(rows, IN, generator=g), torch.randn(rows, OUT, generator=g)
            )
            return DataLoader(data, batch_size=s.batch_size)

    return FuzzModule()


def fit_pair(s: LightningSchedule, ckpt_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Fit the schedule with "ddp" and with BucketDDP on this rank; the state after each.

    With ``resume_at``, each strategy fits that many steps and saves a checkpoint in
    ``ckpt_dir`` (shared by the ranks); a new Trainer then fits a module built from other
    weights, from that checkpoint, up to ``max_steps``.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from bucketddp import BucketDDP
    from lightning_models import QUIET, RegisterCommHook

    hooks = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}
    fn = hooks[s.hook] if s.hook else None

    def fit(label: str, steps: int, resume_from: Path | None, save_to: Path | None) -> Any:
        if label == "ddp":
            strategy: Any = DDPStrategy(**s.options)
            callbacks: list[pl.Callback] = [RegisterCommHook(fn)] if fn is not None else []
        else:
            strategy = BucketDDP(**s.options, ddp_comm_hook=fn)
            callbacks = []
        # A resumed fit builds its module from other weights: the checkpoint must replace
        # them.
        pl.seed_everything(s.seed + (resume_from is not None), verbose=False)
        model = _module(s)
        loop: dict[str, Any] = {}
        if not s.manual:
            loop = {"accumulate_grad_batches": s.accumulate, "gradient_clip_val": s.clip}
        trainer = pl.Trainer(
            **QUIET,
            devices=s.world,
            strategy=strategy,
            max_steps=steps,
            precision=s.precision,  # type: ignore[arg-type]
            limit_val_batches=0,
            callbacks=callbacks,
            **loop,
        )
        trainer.fit(model, ckpt_path=resume_from)
        if save_to is not None:
            trainer.save_checkpoint(save_to)  # every rank calls it; rank 0 writes
        return model

    out = {}
    for label in ("ddp", "bucket"):
        resume_from = None
        if s.resume_at is not None:
            resume_from = ckpt_dir / f"{s.seed}-{label}.ckpt"
            fit(label, s.resume_at, None, resume_from)
        model = fit(label, s.max_steps, resume_from, None)
        out[label] = {k: v.detach().clone() for k, v in model.named_parameters()}
        buffers = {f"buffer:{k}": v.detach().clone() for k, v in model.named_buffers()}
        out[label].update(buffers)
    return out


def child(seeds: list[int], out_dir: Path) -> None:
    """One launch: every seed's fit pair on this rank, saved to ``out_dir``."""
    torch.set_num_threads(1)
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    results = {seed: fit_pair(make_schedule(seed), out_dir) for seed in seeds}
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.save(results, out_dir / f"rank{rank}.pt")


def compare(ranks: list[dict[str, dict[str, torch.Tensor]]]) -> tuple[float, list[str]]:
    """The largest difference between the strategies, and what is out of tolerance."""
    worst, bad = 0.0, []
    for r, states in enumerate(ranks):
        for name, want in states["ddp"].items():
            got = states["bucket"][name]
            if name.startswith("buffer:"):
                # BucketDDP syncs buffers once more at the end of fit (docs/strategy.md,
                # "What happens when"): every rank then holds rank 0's, which "ddp" leaves
                # as each rank's last forward made them.
                want = ranks[0]["ddp"][name]
            if not want.is_floating_point():
                if not torch.equal(got, want):
                    values = f"{got.tolist()} under BucketDDP, {want.tolist()} under ddp"
                    bad.append(f"rank {r} {name}: {values}")
                continue
            diff = (got.double() - want.double()).abs().max().item()
            worst = max(worst, diff)
            if diff > ATOL:
                bad.append(f"rank {r} {name}: differs from ddp by {diff:.3g}")
    for name, first in ranks[0]["bucket"].items():
        for r in range(1, len(ranks)):
            if not torch.equal(ranks[r]["bucket"][name], first):
                bad.append(f"{name}: rank {r} differs from rank 0 under BucketDDP")
    return worst, bad


def run_launch(seeds: list[int], timeout: float) -> dict[int, tuple[bool, str]]:
    """Fit ``seeds``, one launch per world size among them; ``{seed: (ok, detail)}``."""
    by_world: dict[int, list[int]] = {}
    for seed in seeds:
        by_world.setdefault(make_schedule(seed).world, []).append(seed)
    outcomes = {}
    for world, group in by_world.items():
        outcomes.update(_launch(world, group, timeout))
    return {seed: outcomes[seed] for seed in seeds}


def _launch(world: int, seeds: list[int], timeout: float) -> dict[int, tuple[bool, str]]:
    """Fit ``seeds`` (all of world size ``world``) in one launch of ``world`` processes."""
    with tempfile.TemporaryDirectory(prefix="fuzz-lightning-") as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", ",".join(map(str, seeds)), tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return {
                seed: (False, f"launch {seeds} timed out after {timeout:.0f}s") for seed in seeds
            }
        paths = [Path(tmp) / f"rank{r}.pt" for r in range(world)]
        if proc.returncode != 0 or not all(p.exists() for p in paths):
            tail = (proc.stdout + proc.stderr)[-3000:]
            return {
                seed: (False, f"launch {seeds} exited {proc.returncode}:\n{tail}") for seed in seeds
            }
        by_rank = [torch.load(p, weights_only=False) for p in paths]
    outcomes = {}
    for seed in seeds:
        worst, bad = compare([results[seed] for results in by_rank])
        outcomes[seed] = (not bad, f"err {worst:.2g}" + "".join(f"\n    {b}" for b in bad[:8]))
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--replay", type=int, help="run and describe one seed")
    parser.add_argument("--group", type=int, default=10, help="seeds per launch")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child([int(x) for x in args.child[0].split(",")], Path(args.child[1]))
        return 0
    if args.replay is not None:
        print(asdict(make_schedule(args.replay)))
        seeds = [args.replay]
    else:
        seeds = list(range(args.seed, args.seed + args.schedules))
    failed = []
    start = time.monotonic()
    # A launch holds one world size: group the seeds by theirs, keeping their order within.
    seeds.sort(key=lambda seed: make_schedule(seed).world)
    for k in range(0, len(seeds), args.group):
        chunk = seeds[k : k + args.group]
        for seed, (ok, detail) in run_launch(chunk, args.timeout).items():
            verdict = "PASS" if ok else "FAIL"
            print(f"{seed:>6}  {make_schedule(seed).short():<70} {detail}  {verdict}", flush=True)
            if not ok:
                failed.append(seed)
    seconds = time.monotonic() - start
    print(f"\n{len(seeds) - len(failed)} of {len(seeds)} schedules passed in {seconds:.0f}s")
    for seed in failed:
        print(f"FAILED seed {seed}: replay with python3 dev.py fuzz-lightning --replay {seed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
