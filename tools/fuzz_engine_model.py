"""The engine fuzzer's model: a schedule's network, its batches and its loss.

``build_model`` makes the same weights from a schedule's seed on every rank and in the
reference; ``batch`` makes each rank's inputs from the step, micro-batch and rank alone.
The custom buffer policies a schedule may name (``CUSTOM``) live here too, since both the
ranks and the reference (``fuzz_engine_reference.py``) compute them.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fuzz_engine_buffers import FLAG_AT
from fuzz_engine_schedule import IN, OUT, TOKENS, VOCAB, Schedule

LR, MOMENTUM = 0.05, 0.9
"""SGD's, on the ranks and in the reference."""


def _gathered(buf: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    gathered = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, buf, group=group)
    return gathered


def median_of_ranks(buf: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A custom buffer policy that returns its value: the elementwise median over ranks."""
    return torch.stack(_gathered(buf, group)).median(dim=0).values


def weighted_mean_of_ranks(buf: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """A custom buffer policy that edits in place: the mean over ranks, rank r weighing r+1."""
    buf.copy_(weighted_mean(_gathered(buf, group)))


def weighted_mean(values: Sequence[torch.Tensor]) -> torch.Tensor:
    weights = [float(r + 1) for r in range(len(values))]
    total = sum((w * v for w, v in zip(weights, values, strict=True)), torch.zeros_like(values[0]))
    return total / sum(weights)


CUSTOM = {"median": median_of_ranks, "wmean": weighted_mean_of_ranks}


class Opaque:
    """A forward's outputs in an object the wrapper's output hooks do not open."""

    def __init__(self, outputs: tuple[torch.Tensor, ...]) -> None:
        self.outputs = outputs


class Stats(nn.Module):
    """Buffers that forward updates from the batch and reads (``STATS_BUFFERS``).

    The output depends on the float buffers, so a buffer synced wrongly shows in the
    parameters too. Counters and flags depend on the inputs alone, so they are exact.
    """

    def __init__(self, width: int, reassign: bool) -> None:
        super().__init__()
        self.reassign = reassign
        self.seen: torch.Tensor
        self.tokens: torch.Tensor
        self.mass: torch.Tensor
        self.ema: torch.Tensor
        self.hi: torch.Tensor
        self.lo: torch.Tensor
        self.own: torch.Tensor
        self.med: torch.Tensor
        self.any_big: torch.Tensor
        self.all_small: torch.Tensor
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("tokens", torch.zeros(VOCAB, dtype=torch.long))
        self.register_buffer("mass", torch.zeros(width))
        self.register_buffer("ema", torch.zeros(width))
        self.register_buffer("hi", torch.full((width,), -0.5))
        self.register_buffer("lo", torch.full((width,), 0.5))
        self.register_buffer("own", torch.zeros(width))
        self.register_buffer("med", torch.zeros(width))
        self.register_buffer("any_big", torch.zeros(IN, dtype=torch.bool))
        self.register_buffer("all_small", torch.ones(IN, dtype=torch.bool))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        out = h + 0.1 * torch.tanh(self.ema + self.own - self.med) + 0.05 * (self.hi + self.lo)
        with torch.no_grad():
            a = h.detach()
            n = torch.tensor(x.shape[0], dtype=torch.long)
            if self.reassign:
                self.seen = self.seen + n
                self.mass = self.mass + a.abs().sum(0)
            else:
                self.seen.add_(n)
                self.mass.add_(a.abs().sum(0))
            self.tokens.add_(torch.bincount(tokens.flatten(), minlength=VOCAB))
            self.ema.mul_(0.8).add_(a.mean(0), alpha=0.2)
            self.hi.copy_(torch.maximum(self.hi, a.amax(0)))
            self.lo.copy_(torch.minimum(self.lo, a.amin(0)))
            self.own.mul_(0.5).add_(a.mean(0))
            self.med.mul_(0.7).add_(a.mean(0) - a.amin(0), alpha=0.3)
            self.any_big |= (x.abs() > FLAG_AT).any(0)
            self.all_small &= (x.abs() < FLAG_AT).all(0)
        return out


class FuzzNet(nn.Module):
    """The schedule's model: optional blocks around an input layer and a head."""

    def __init__(self, s: Schedule) -> None:
        super().__init__()
        w = s.width
        self.inp = nn.Linear(IN, w)
        self.bn = nn.BatchNorm1d(w) if s.bn else None
        self.trunk = nn.ModuleList(nn.Linear(w, w) for _ in range(s.depth))
        self.repeat = s.repeat
        # Set on the ranks' models only (see ``train_rank``).
        self.ckpt: str | None = None
        self.opaque = False
        self.whole = s.whole
        self.head_ckpt = s.head_ckpt
        self.stats = Stats(w, s.reassign) if s.stats else None
        self.emb = nn.Embedding(VOCAB, w) if s.tied else None
        self.out = nn.Linear(w, VOCAB, bias=False) if s.tied else None
        if self.out is not None and self.emb is not None:
            self.out.weight = self.emb.weight
        self.lookup = nn.Embedding(VOCAB, w, sparse=True) if s.sparse else None
        self.f64 = nn.Linear(w, w).double() if s.double else None
        self.branch = nn.Linear(w, w) if s.branch else None
        self.spare = nn.Linear(w, w) if s.spare else None
        self.head = nn.Linear(w, OUT)

    def forward(
        self, x: torch.Tensor, tokens: torch.Tensor, use_branch: bool, use_lookup: bool
    ) -> tuple[torch.Tensor, ...] | Opaque:
        out = self.rest(self.front(x), x, tokens, use_branch, use_lookup)
        return Opaque(out) if self.opaque else out

    def front(self, x: torch.Tensor) -> torch.Tensor:
        """The input layer and BatchNorm: the part the SyncBatchNorm reference runs globally."""
        h = self.inp(x)
        if self.bn is not None:
            h = self.bn(h)
        return h

    def rest(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        tokens: torch.Tensor,
        use_branch: bool,
        use_lookup: bool,
    ) -> tuple[torch.Tensor, ...]:
        """Everything after ``front``."""
        h = self.run_trunk(torch.tanh(h))
        if self.stats is not None:
            h = self.stats(x, tokens, h)
        if self.emb is not None:
            h = h + self.emb(tokens).mean(dim=1)
        if self.lookup is not None and use_lookup:
            h = h + self.lookup(tokens).mean(dim=1)
        if self.f64 is not None:
            h = h + torch.tanh(self.f64(h.double())).to(h.dtype)
        if self.branch is not None and use_branch:
            h = h + torch.tanh(self.branch(h))
        y = self.segment(self.head, h) if self.head_ckpt else self.head(h)
        if self.out is None:
            return (y,)
        return y, self.out(h)

    def run_trunk(self, h: torch.Tensor) -> torch.Tensor:
        """The trunk layers (``trunk.0`` again if ``repeat``), checkpointed if ``ckpt``.

        Reentrant checkpointing needs an input that requires a gradient: without one (the
        input layer frozen, no BatchNorm) the trunk runs plainly, as in the reference.
        """
        layers = [*self.trunk, *self.trunk[:1]] if self.repeat else list(self.trunk)
        if self.ckpt is None or not h.requires_grad:
            return _chain(layers, h)  # decided once, at the trunk's input
        if self.whole:
            return self.segment(functools.partial(_chain, layers), h)
        for layer in layers:
            h = self.segment(functools.partial(_chain, [layer]), h)
        return h

    def segment(self, fn: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """``fn(h)``, in a checkpoint segment of the ``ckpt`` kind if there is one to make."""
        if self.ckpt is None or not h.requires_grad:
            return fn(h)
        out = checkpoint(fn, h, use_reentrant=self.ckpt == "reentrant")
        return cast(torch.Tensor, out)


def _chain(layers: Sequence[nn.Module], h: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        h = torch.tanh(layer(h))
    return h


def build_model(s: Schedule) -> FuzzNet:
    """The schedule's model, initialized from its seed; the freeze target as when wrapped."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        model = FuzzNet(s)
    set_target(model, s, s.steps[0].target_trains)
    return model


def set_target(model: nn.Module, s: Schedule, trains: bool) -> None:
    if s.freeze is not None:
        model.get_submodule(s.freeze).requires_grad_(trains)


def batch(s: Schedule, step: int, micro: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s inputs and targets for one forward: a function of the indices only."""
    g = torch.Generator().manual_seed(
        random.Random(f"{s.seed}/{step}/{micro}/{rank}").getrandbits(62)
    )
    n = s.batch_sizes[rank]
    x = torch.randn(n, IN, generator=g)
    tokens = torch.randint(0, VOCAB, (n, TOKENS), generator=g)
    y = torch.randn(n, OUT, generator=g)
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    return x, tokens, y, labels


def loss_of(out: tuple[torch.Tensor, ...], y: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(out[0], y)
    if len(out) > 1:
        loss = loss + F.cross_entropy(out[1], labels)
    return loss


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def rank_values(values: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Buffer values as rank ``rank`` has them before wrapping: each rank's differ."""
    out = {}
    for name, b in values.items():
        if b.dtype == torch.bool:
            out[name] = b ^ (rank % 2 == 1)
        elif b.is_floating_point():
            out[name] = b + 0.05 * rank
        else:
            out[name] = b + rank
    return out
