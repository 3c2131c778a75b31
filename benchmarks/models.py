"""The benchmark models and their synthetic batches.

Each model is described by a :class:`ModelSpec`: a builder that returns the same weights for
the same seed, and a batch maker that returns the same ``(inputs, targets)`` for the same
generator state. Every model returns logits of shape ``(N, classes)`` and every batch
carries integer targets of shape ``(N,)``, so one loss (cross-entropy) serves them all.

Other benchmarks import this module, so it does nothing at import time beyond defining
classes and functions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------------------ MLP
MLP_WIDTHS = (768, 2048, 2048, 1024, 16)


class MLP(nn.Module):
    """A plain ReLU MLP; with the default widths about 7.9M parameters (31 MB of float32)."""

    def __init__(self, widths: tuple[int, ...] = MLP_WIDTHS) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
            layers.append(nn.Linear(fan_in, fan_out))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp_batch(batch_size: int, generator: torch.Generator) -> Batch:
    """Gaussian inputs and uniform class labels for :class:`MLP`."""
    x = torch.randn(batch_size, MLP_WIDTHS[0], generator=generator)
    y = torch.randint(0, MLP_WIDTHS[-1], (batch_size,), generator=generator)
    return x, y


# ------------------------------------------------------------------------- conv net
class ConvNet(nn.Module):
    """A small CIFAR-shaped conv net, Conv-BatchNorm-ReLU blocks (about 0.24M parameters).

    The BatchNorm running statistics are buffers, so a data-parallel wrapper has buffers
    to broadcast before every forward as well as gradients to reduce.
    """

    def __init__(self, channels: tuple[int, ...] = (32, 64, 128, 128), classes: int = 10) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        c_in = 3
        for i, c_out in enumerate(channels):
            blocks += [
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(),
            ]
            if 0 < i < len(channels) - 1:
                blocks.append(nn.MaxPool2d(2))
            c_in = c_out
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        return self.head(h.mean(dim=(2, 3)))


CONV_IMAGE = (3, 32, 32)


def conv_batch(batch_size: int, generator: torch.Generator) -> Batch:
    """Gaussian 3x32x32 images and labels in [0, 10) for :class:`ConvNet`."""
    x = torch.randn(batch_size, *CONV_IMAGE, generator=generator)
    y = torch.randint(0, 10, (batch_size,), generator=generator)
    return x, y


# ---------------------------------------------------------------------- transformer
VOCAB = 512
SEQ_LEN = 64


class TinyTransformer(nn.Module):
    """A causal language model: token and position embeddings, pre-norm encoder layers and
    an untied output head (about 0.93M parameters with the defaults).

    ``forward`` takes token ids ``(B, T)`` and returns next-token logits ``(B*T, vocab)``.
    The causal mask is made in ``forward`` rather than kept as a buffer, so it is not a
    buffer that a data-parallel wrapper would broadcast every step.
    """

    def __init__(
        self,
        vocab: int = VOCAB,
        seq_len: int = SEQ_LEN,
        d_model: int = 128,
        heads: int = 4,
        layers: int = 4,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model,
            heads,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.tokens(tokens) + self.positions[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        h = self.encoder(h, mask=mask, is_causal=True)
        return self.head(self.norm(h)).reshape(-1, self.head.out_features)


def transformer_batch(batch_size: int, generator: torch.Generator) -> Batch:
    """Random token sequences; the targets are the inputs shifted by one position."""
    seq = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=generator)
    return seq[:, :-1], seq[:, 1:].reshape(-1)


# -------------------------------------------------------- deep, narrow transformer
DEEP_LAYERS = 25
DEEP_WIDTH = 64


def deep_transformer() -> TinyTransformer:
    """:class:`TinyTransformer` 25 layers deep and 64 wide: 306 parameter tensors, 12 per
    layer of at most 16K elements each, about 1.32M parameters in all.

    Many small gradients and little arithmetic per step: where a Python hook per parameter
    costs the most next to torch DDP's C++ reducer.
    """
    return TinyTransformer(d_model=DEEP_WIDTH, heads=4, layers=DEEP_LAYERS)


# ------------------------------------------------------------------- small models
DIGITS_WIDTHS = (64, 512, 512, 10)
TINY_WIDTHS = (64, 64, 32, 10)


def digits_mlp() -> MLP:
    """examples/demo.py's MLP for 8x8 digits: 64-512-512-10, 301K parameters in 6 tensors."""
    return MLP(DIGITS_WIDTHS)


def tiny_mlp() -> MLP:
    """A 64-64-32-10 MLP: 6.6K parameters in 6 tensors, where a fixed cost per step shows."""
    return MLP(TINY_WIDTHS)


def pixels_batch(batch_size: int, generator: torch.Generator) -> Batch:
    """Pixel values in [0, 1] of 64 features (8x8 images) and labels in [0, 10)."""
    x = torch.rand(batch_size, DIGITS_WIDTHS[0], generator=generator)
    y = torch.randint(0, DIGITS_WIDTHS[-1], (batch_size,), generator=generator)
    return x, y


SMALL_IMAGE = (3, 16, 16)


def small_convnet() -> ConvNet:
    """:class:`ConvNet` with two Conv-BatchNorm-ReLU blocks of 16 and 32 channels: 5.5K
    parameters in 8 tensors, and 6 buffers."""
    return ConvNet(channels=(16, 32))


def small_conv_batch(batch_size: int, generator: torch.Generator) -> Batch:
    """Gaussian 3x16x16 images and labels in [0, 10) for :func:`small_convnet`."""
    x = torch.randn(batch_size, *SMALL_IMAGE, generator=generator)
    y = torch.randint(0, 10, (batch_size,), generator=generator)
    return x, y


# ------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class ModelSpec:
    """How to build one benchmark model and feed it.

    Attributes:
        name: the key used on the command line and in result files.
        factory: builds the model with freshly initialized weights.
        make_batch: ``(batch_size, generator) -> (inputs, targets)``.
        batch_size: the per-rank batch size the benchmark uses by default.
    """

    name: str
    factory: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], Batch]
    batch_size: int

    def build(self, seed: int = 0) -> nn.Module:
        """The model, initialized from ``seed`` without disturbing the global RNG."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.factory()

    def batch(self, batch_size: int | None = None, *, seed: int = 0) -> Batch:
        """A synthetic batch; the same ``seed`` gives the same batch."""
        generator = torch.Generator().manual_seed(seed)
        return self.make_batch(batch_size or self.batch_size, generator)


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross-entropy of ``model(inputs)`` against the targets."""
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", MLP, mlp_batch, batch_size=32),
    "convnet": ModelSpec("convnet", ConvNet, conv_batch, batch_size=16),
    "transformer": ModelSpec("transformer", TinyTransformer, transformer_batch, batch_size=8),
    "deep_transformer": ModelSpec(
        "deep_transformer", deep_transformer, transformer_batch, batch_size=4
    ),
    "digits_mlp": ModelSpec("digits_mlp", digits_mlp, pixels_batch, batch_size=32),
    "tiny_mlp": ModelSpec("tiny_mlp", tiny_mlp, pixels_batch, batch_size=32),
    "small_convnet": ModelSpec("small_convnet", small_convnet, small_conv_batch, batch_size=16),
}


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameter elements."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def count_tensors(model: nn.Module) -> int:
    """Number of trainable parameter tensors: the gradients a reducer handles per step."""
    return sum(1 for p in model.parameters() if p.requires_grad)
