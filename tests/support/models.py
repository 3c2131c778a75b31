"""Small models and a training loop shared by the engine tests.

Every model is built from a fixed seed, and every batch is a function of (step, rank), so
two systems trained in the same process group see identical inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.nn.utils.prune
import torch.utils.checkpoint
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU()
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class TiedLM(nn.Module):
    """Embedding and output layer share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.mix = nn.Linear(16, 16)
        self.out = nn.Linear(16, 20, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.emb(x)))).mean(dim=1)


class Frozen(MLP):
    """The first layer is frozen."""

    def __init__(self) -> None:
        super().__init__()
        for p in self.net[0].parameters():
            p.requires_grad_(False)


class MixedDtype(nn.Module):
    """A float64 submodule beside float32 ones."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 16)
        self.b = nn.Linear(16, 16).double()
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x)).double()
        return self.c(torch.relu(self.b(h)).float())


class Branchy(nn.Module):
    """Control flow picks a branch per call; ``never`` is used by no rank."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(10, 16)
        self.left = nn.Linear(16, 16)
        self.right = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_left: bool = True) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = self.left(h) if use_left else self.right(h)
        return self.head(torch.relu(h))


class Checkpointed(MLP):
    """The middle of the network is recomputed in backward (non-reentrant checkpointing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.net[0](x))
        h = torch.utils.checkpoint.checkpoint(self.net[1:4], h, use_reentrant=False)
        return self.net[4](h)


class Reentrant(MLP):
    """Two reentrant checkpoint segments; the first gradients come from a nested backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A reentrant segment passes gradients on only through inputs that require them.
        h = torch.utils.checkpoint.checkpoint(
            self.net[0:2], x.detach().requires_grad_(), use_reentrant=True
        )
        return torch.utils.checkpoint.checkpoint(self.net[2:5], h, use_reentrant=True)


class Boxed:
    """A forward's output in a plain object, which the wrapper's output hooks do not open."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class ReentrantBoxed(Reentrant):
    """``Reentrant``, its output boxed: no output hook sees the backward start."""

    def forward(self, x: torch.Tensor) -> Boxed:  # type: ignore[override]
        return Boxed(super().forward(x))


class SharedSegments(MLP):
    """One layer runs in two reentrant checkpoint segments: two gradients per backward.

    ``net.1`` (a ReLU) keeps MLP's parameter names; ``net.2`` is the shared layer.
    """

    segments = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.net[0](x))
        for _ in range(self.segments):
            h = torch.utils.checkpoint.checkpoint(self._mid, h, use_reentrant=True)
        return self.net[4](h)

    def _mid(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.net[2](h))


class SparseEmb(nn.Module):
    """Two sparse-gradient embeddings beside dense layers; ``use_left`` picks one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.bag = nn.EmbeddingBag(20, 8, mode="sum", sparse=True)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, use_left: bool | None = None) -> torch.Tensor:
        if use_left is None:
            h = self.emb(x).mean(dim=1) + self.bag(x)
        else:
            h = self.emb(x).mean(dim=1) if use_left else self.bag(x)
        return self.head(torch.tanh(self.mix(h)))


class SparseOnly(nn.Module):
    """Nothing but a sparse-gradient embedding: no dense bucket at all."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 4, mode="mean", sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bag(x)


class Reparametrized(nn.Module):
    """Weights computed in forward: spectral norm (both APIs), weight norm and pruning.

    Spectral norm updates its ``_u``/``_v`` buffers in every training forward, and pruning
    multiplies by a mask buffer, so buffers and parameters both take part.
    """

    def __init__(self) -> None:
        super().__init__()
        utils = nn.utils
        self.a = utils.parametrizations.spectral_norm(nn.Linear(10, 32))
        self.b = utils.spectral_norm(nn.Linear(32, 32))
        self.c = utils.parametrizations.weight_norm(nn.Linear(32, 32))
        self.d = nn.Linear(32, 4)
        torch.nn.utils.prune.l1_unstructured(self.d, "weight", amount=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


class Recurrent(nn.Module):
    """A two-layer LSTM over three copies of the input, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(10, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.unsqueeze(1).repeat(1, 3, 1))
        return self.head(out[:, -1])


def _channels_last() -> nn.Module:
    """The conv net in channels_last memory format: its conv weights are not contiguous."""
    return ConvNet().to(memory_format=torch.channels_last)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "conv": ConvNet,
    "channels_last": _channels_last,
    "reparametrized": Reparametrized,
    "recurrent": Recurrent,
    "tied": TiedLM,
    "frozen": Frozen,
    "mixed": MixedDtype,
    "branchy": Branchy,
    "checkpointed": Checkpointed,
    "reentrant": Reentrant,
    "reentrant_boxed": ReentrantBoxed,
    "shared_segments": SharedSegments,
    "sparse": SparseEmb,
    "sparse_only": SparseOnly,
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def batch(name: str, step: int, rank: int, size: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name in ("conv", "channels_last"):
        x = torch.randn(size, 3, 8, 8, generator=g)
        if name == "channels_last":
            x = x.to(memory_format=torch.channels_last)
    elif name.startswith("sparse"):
        x = torch.randint(0, 20, (size, 5), generator=g)
    elif name == "tied":
        x = torch.randint(0, 20, (size, 5), generator=g)
        return x, torch.randn(size, 20, generator=g)
    else:
        x = torch.randn(size, 10, generator=g)
    return x, torch.randn(size, 4, generator=g)


def train(
    name: str,
    wrap: Callable[[nn.Module], nn.Module],
    rank: int,
    *,
    steps: int | Sequence[int] = 4,
    accumulate: int = 1,
    set_to_none: bool = True,
    branch: Callable[[int, int], bool] | None = None,
    join: dict[str, Any] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Train ``steps`` SGD-momentum steps through ``wrap(model)``; return the final state.

    ``steps`` may give each rank its own count (uneven inputs); ``join`` then holds the
    keyword arguments of the wrapper's ``join()``, which the loop runs inside. The model
    and its batches live on ``device``; the state comes back on the CPU.
    """
    model = build(name).to(device)
    wrapped = wrap(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    mine = steps if isinstance(steps, int) else steps[rank]
    with wrapped.join(**join) if join is not None else contextlib.nullcontext():  # type: ignore[operator]
        _loop(name, wrapped, opt, rank, mine, accumulate, set_to_none, branch, device)
    return {
        "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().cpu().clone() for n, b in model.named_buffers()},
        "wrapped": wrapped,
    }


def _loop(
    name: str,
    wrapped: nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    steps: int,
    accumulate: int,
    set_to_none: bool,
    branch: Callable[[int, int], bool] | None,
    device: str,
) -> None:
    for step in range(steps):
        for micro in range(accumulate):
            x, y = (t.to(device) for t in batch(name, step * accumulate + micro, rank))
            last = micro == accumulate - 1
            ctx = contextlib.nullcontext() if last else wrapped.no_sync()  # type: ignore[operator]
            with ctx:
                kwargs = {"use_left": branch(rank, step)} if branch else {}
                loss = F.mse_loss(wrapped(x, **kwargs), y)
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


def train_global(
    name: str,
    steps: Sequence[int],
    *,
    by_initial: bool = True,
    branch: Callable[[int, int], bool] | None = None,
    set_to_none: bool = True,
    accumulate: int = 1,
) -> dict[str, torch.Tensor]:
    """The ground truth of ``train``: one process, each step on the global batch.

    Rank ``r`` has ``steps[r]`` batches; each step, the ranks that still have one each add
    their loss, divided by the world size (``by_initial``) or by the number of them, for
    each of ``accumulate`` micro-batches.
    """
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(max(steps)):
        training = [r for r in range(len(steps)) if steps[r] > step]
        for micro in range(accumulate):
            for r in training:
                x, y = batch(name, step * accumulate + micro, r)
                kwargs = {"use_left": branch(r, step)} if branch else {}
                loss = F.mse_loss(model(x, **kwargs), y)
                (loss / (len(steps) if by_initial else len(training))).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rank: int) -> None:
    """Every tensor of ``want`` equals ``got``'s to 1e-6 (the engine tests' tolerance)."""
    for name, value in want.items():
        torch.testing.assert_close(
            got[name], value, rtol=0, atol=1e-6, msg=f"{name} on rank {rank}"
        )


def split_flags(rows: Callable[[int], int]) -> None:
    """In this rank's process, write the reducer's flags in ``rows(world_size)`` rows.

    bfloat16 counts ranks exactly only up to 256: past that the flags are split in rows.
    Forcing the rows lets that path run at a world size this machine can hold.
    """
    from bucketddp.reducer import agreement

    agreement.row_count = lambda dtype, world_size: rows(world_size)  # type: ignore[assignment]


def paired(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Two ``train`` results side by side: parameters and buffers, (ours, theirs) each."""
    return {k: (ours[k], theirs[k]) for k in ("params", "buffers")}


def assert_pairs_match(results: Sequence[dict[str, tuple[Any, Any]]]) -> None:
    """Every rank's ``paired`` states agree to 1e-6, parameters and buffers."""
    for rank, r in enumerate(results):
        for ours, theirs in r.values():
            assert_weights(ours, theirs, rank)
