"""The modules the tests train that are not GPTs, for `zerofunc.initialize`'s "any nn.Module": odd widths, blocks in a
ModuleList or an nn.Sequential, a tied head, and forwards that run their blocks as real models do (again, on some
micro-batches only, out of the modules' order, through their forward method, checkpointed by the model); and their
data."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.steps import ignore_some


class ResidualMLP(nn.Module):
    """Not a GPT: odd widths, a ModuleList of blocks, a loss computed in forward."""

    def __init__(self, d_in: int = 7, width: int = 13, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return F.mse_loss(self.out(h).squeeze(-1), y)


def token_loss(logits: torch.Tensor, targets: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Hugging Face's convention: the summed token loss / num_items_in_batch; the targets' own mean without it."""
    logits, t = logits.flatten(0, 1).float(), targets.flatten()
    if num_items_in_batch is None:
        return F.cross_entropy(logits, t, ignore_index=-100)
    return F.cross_entropy(logits, t, ignore_index=-100, reduction="sum") / num_items_in_batch


class TokenMLP(nn.Module):
    """A language model that is not a transformer, in Hugging Face's convention: its forward takes
    `num_items_in_batch` and returns the summed token loss divided by it (the targets' own mean without it)."""

    def __init__(self, vocab: int = 19, width: int = 11, depth: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def runs(self, idx: torch.Tensor) -> list[nn.Module]:
        """The blocks in the order the forward runs them."""
        return list(self.blocks)

    def forward(self, idx, targets, num_items_in_batch=None):
        h = self.emb(idx)
        for block in self.runs(idx):
            h = h + block(h)
        return token_loss(self.head(h), targets, num_items_in_batch)


class ReusedLM(TokenMLP):
    """TokenMLP whose forward runs its first block again after the last, twice (weights shared across depth, as
    ALBERT's): that block's gradient is the sum over its three runs, reduced once a micro-step."""

    def runs(self, idx: torch.Tensor) -> list[nn.Module]:
        return [*self.blocks, self.blocks[0], self.blocks[0]]


class PartlyRunLM(TokenMLP):
    """TokenMLP with four blocks: the forward runs the second only on sequences of more than 4 tokens (a step's
    first micro-step; the accumulation boundary's are shorter: `micro_batches`), the fourth never (a module the
    loss does not use). The second's gradient is the first micro-step's; the fourth's is zero, as DeepSpeed's
    ignore_unused_parameters has it: AdamW still steps it (its weight decay)."""

    def __init__(self):
        super().__init__(depth=4)

    def runs(self, idx: torch.Tensor) -> list[nn.Module]:
        return [self.blocks[0], *([self.blocks[1]] if idx.shape[1] > 4 else []), self.blocks[2]]


class CalledDirectlyLM(TokenMLP):
    """TokenMLP whose forward calls its second block's forward method (`block.forward(h)`), which runs none of the
    module's hooks, where the engine learns that a block starts and ends."""

    def runs(self, idx: torch.Tensor) -> list:
        return [self.blocks[0], self.blocks[1].forward]


class SelfCheckpointedLM(TokenMLP):
    """TokenMLP that checkpoints its own blocks (`torch.utils.checkpoint`, as timm's `set_grad_checkpointing` and
    much research code do): backward calls each block again to recompute it."""

    def runs(self, idx: torch.Tensor) -> list:
        return [functools.partial(checkpoint, block, use_reentrant=False) for block in self.blocks]


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())

    def forward(self, h):
        return h + self.f(h)


class SequentialLM(TokenMLP):
    """TokenMLP with its blocks in an nn.Sequential that runs them (as timm's vision transformers keep
    theirs), and in it too the embedding and a head tied to it: stage 3 gathers each block (and the final
    norm) alone, and leaves the embedding and the head, which share a weight, to the root unit."""

    def __init__(self, vocab: int = 19, width: int = 11, depth: int = 2):
        nn.Module.__init__(self)
        emb, head = nn.Embedding(vocab, width), nn.Linear(width, vocab, bias=False)
        head.weight = emb.weight
        self.layers = nn.Sequential(emb, *(Residual(width) for _ in range(depth)), nn.LayerNorm(width), head)

    def forward(self, idx, targets, num_items_in_batch=None):
        return token_loss(self.layers(idx), targets, num_items_in_batch)


class CrossBlock(nn.Module):
    """A decoder block: its input plus what the encoder made (`memory`), read once."""

    def __init__(self, width: int):
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())

    def forward(self, h, memory):
        return h + self.f(h + memory)


class EncoderDecoderLM(TokenMLP):
    """TokenMLP as an encoder and a decoder, sub-models with a stack of blocks each, of their own classes (T5's,
    BART's, Whisper's shape): 2 encoder blocks over the tokens, then 3 decoder blocks over the tokens' own decoder
    embedding that each read the encoder's output. Stage 3 gathers the blocks of both stacks, the smaller too,
    each alone.

    (One embedding for both would be one device's only within a wider budget than tests/steps.py's: its output's
    gradient, from the two stacks, is summed in another order than one autograd graph sums it.)"""

    def __init__(self, vocab: int = 19, width: int = 11):
        super().__init__(vocab, width, depth=0)
        del self.blocks
        self.dec_emb = nn.Embedding(vocab, width)
        self.encoder, self.decoder = nn.Module(), nn.Module()
        self.encoder.blocks = nn.ModuleList(Residual(width) for _ in range(2))
        self.decoder.blocks = nn.ModuleList(CrossBlock(width) for _ in range(3))

    def forward(self, idx, targets, num_items_in_batch=None):
        h, memory = self.dec_emb(idx), self.emb(idx)
        for block in self.encoder.blocks:
            memory = block(memory)
        for block in self.decoder.blocks:
            h = block(h, memory)
        return token_loss(self.head(h), targets, num_items_in_batch)


class Adapter(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.down, self.up = nn.Linear(width, 3), nn.Linear(3, width)

    def forward(self, h):
        return self.up(F.gelu(self.down(h)))


class AdaptedBlock(Residual):
    def forward(self, h, adapter):
        return h + self.f(h) + adapter(h)


class AdaptedLM(TokenMLP):
    """TokenMLP whose blocks are each handed an adapter from a stack beside theirs, which runs inside the block: the
    adapters are no units by default (a unit cannot run inside another), their weights the root unit's."""

    def __init__(self, vocab: int = 19, width: int = 11):
        super().__init__(vocab, width, depth=0)
        self.blocks = nn.ModuleList(AdaptedBlock(width) for _ in range(2))
        self.adapters = nn.ModuleList(Adapter(width) for _ in range(2))

    def runs(self, idx: torch.Tensor) -> list:
        return [functools.partial(block, adapter=adapter) for block, adapter in zip(self.blocks, self.adapters)]


MODULES = {"regression": ResidualMLP, "tokens": TokenMLP, "sequential": SequentialLM, "reused": ReusedLM,
           "partly run": PartlyRunLM, "called directly": CalledDirectlyLM, "self-checkpointed": SelfCheckpointedLM,
           "encoder-decoder": EncoderDecoderLM}
OPTIM = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-5, "weight_decay": 0.1}}


def batches(kind: str, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch for `kind`: features and regression targets, or tokens and next-token targets with
    ignored positions (-100) that count differently on each rank and micro-step."""
    if kind == "regression":
        return torch.randn(rows, 7, generator=gen), torch.randn(rows, generator=gen)
    tokens = torch.randint(0, 19, (rows, 6), generator=gen)
    return tokens[:, :-1], ignore_some(tokens[:, 1:], gen)


def micro_batches(kind: str, world: int, accum: int, gen: torch.Generator) -> list[tuple]:
    """A step's micro-batches of 2 rows, every rank's: micro-step j of rank r takes j * world + r. For a
    PartlyRunLM, micro-step j's sequences are j tokens shorter than the first's."""
    x, y = batches(kind, 2 * world * accum, gen)
    everyone = [(x[i * 2:(i + 1) * 2], y[i * 2:(i + 1) * 2]) for i in range(world * accum)]
    if kind == "partly run":
        everyone = [(a[:, :5 - i // world], b[:, :5 - i // world]) for i, (a, b) in enumerate(everyone)]
    return everyone


class Ordered(TokenMLP):
    """TokenMLP with four blocks, whose forward runs them in `order`: not the modules' order, one more than once,
    one not at all; with `checkpointed`, each through torch.utils.checkpoint (backward calls it again)."""

    def __init__(self, order: tuple[int, ...], checkpointed: bool = False):
        super().__init__(depth=4)
        self.order, self.checkpointed = order, checkpointed

    def runs(self, idx: torch.Tensor) -> list:
        blocks = [self.blocks[i] for i in self.order]
        return [functools.partial(checkpoint, b, use_reentrant=False) for b in blocks] if self.checkpointed else blocks


CHECKPOINTED = "modules', checkpointed by the model"
ORDERS = {"modules'": (0, 1, 2, 3), "reversed": (3, 2, 1, 0), "one run again": (0, 1, 2, 3, 0, 0),
          "one not run": (0, 2, 3), CHECKPOINTED: (0, 1, 2, 3)}
