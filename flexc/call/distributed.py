"""Context parallelism: one long sequence split across processes, planned from the BlockMask.

Each rank holds a shard of the query, key and value sequence. The shards are made of whole query
blocks of the BlockMask, assigned so that every rank gets about the same number of non-empty tiles
(:func:`plan_context_parallel`). A rank fetches, with torch.distributed point-to-point calls, only
the key/value *blocks* its query blocks have a non-empty tile with; a (rank, rank) pair that shares
no tile exchanges nothing. Attention over the rank's own keys runs while the remote blocks are in
flight; the two partial results are merged by their logsumexp. The backward keeps dq local and
sends the gradients of fetched key/value blocks back to their owners (the reverse exchange), in
flight while the backward of the attention over the rank's own keys runs.

Mods see global indices: every call runs the user's mods on ``q_idx``/``kv_idx`` mapped back to
their place in the full sequence. Only self-attention is supported (one sequence sharded for
queries and keys alike): the BlockMask must be square with equal query and key block sizes.

    >>> plan = plan_context_parallel(causal_block_mask, world_size=4)
    >>> q_local = shard_sequence(q, causal_block_mask)            # every rank: its own shard
    >>> out_local = flex_attention(q_local, k_local, v_local, block_mask=causal_block_mask)
    >>> out = unshard_sequence(out_local, causal_block_mask)      # the full output on every rank
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import attention as _attention
from ..backends import dropout
from ..backends.cpu.block_plan import memo_by_tables
from ..mods import derived
from ..masks.mask_mods import noop_mask
from .sinks import check_sinks
from ..analysis.tiles import FULL, PARTIAL, dense_to_ordered
from ..mods.trace import SCORE_MOD, trace

__all__ = ["ContextParallelPlan", "plan_context_parallel", "shard_sequence", "unshard_sequence", "flex_attention"]


# ---- the plan ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContextParallelPlan:
    """Who holds which query/key blocks and what every rank fetches, derived from a BlockMask.

    Attributes:
        world_size: number of ranks.
        block_size: tokens per block (the BlockMask's query and key block size).
        seq_len: tokens in the full sequence.
        blocks: per rank, the global block indices it holds, ascending (its shard is their tokens in order).
        work: per rank, non-empty tiles of its query blocks, summed over the mask's batch and heads.
        fetch: ``fetch[r][s]``: the key/value blocks rank ``r`` receives from rank ``s`` (empty for ``s == r``).
        layout: ``"zigzag"`` (2R equal-length chunks, rank r holding chunks r and 2R-1-r),
            ``"balanced-zigzag"`` (the same pairing over 2R chunks of equal work) or ``"contiguous"``.
    """

    world_size: int
    block_size: int
    seq_len: int
    blocks: tuple[tuple[int, ...], ...]
    work: tuple[int, ...]
    fetch: tuple[tuple[tuple[int, ...], ...], ...]
    layout: str

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.seq_len / self.block_size)

    def block_tokens(self, block: int) -> int:
        """Real tokens of ``block`` (the last block of a ragged sequence is shorter)."""
        return min(self.block_size, self.seq_len - block * self.block_size)

    def shard_len(self, rank: int) -> int:
        """Tokens in ``rank``'s shard."""
        return sum(self.block_tokens(b) for b in self.blocks[rank])

    def token_index(self, rank: int) -> torch.Tensor:
        """int64 global positions of ``rank``'s shard, in shard order."""
        parts = [torch.arange(b * self.block_size, b * self.block_size + self.block_tokens(b))
                 for b in self.blocks[rank]]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def recv_tokens(self, rank: int) -> int:
        """Key/value token slots ``rank`` receives (whole blocks: a ragged last block travels padded)."""
        return self.block_size * sum(len(f) for f in self.fetch[rank])

    def send_tokens(self, rank: int) -> int:
        """Key/value token slots ``rank`` sends to the others."""
        return self.block_size * sum(len(self.fetch[r][rank]) for r in range(self.world_size))

    def skipped_pairs(self, rank: int) -> tuple[int, ...]:
        """Other ranks from which ``rank`` receives nothing (no non-empty tile with their blocks)."""
        return tuple(s for s in range(self.world_size) if s != rank and not self.fetch[rank][s])

    def sources(self, rank: int) -> tuple[int, ...]:
        """Other ranks that ``rank`` receives key/value blocks from."""
        return tuple(s for s in range(self.world_size) if s != rank and self.fetch[rank][s])

    def bytes_received(self, rank: int, token_bytes: int) -> int:
        """Bytes ``rank`` receives, for ``token_bytes`` bytes of key plus value per token."""
        return self.recv_tokens(rank) * token_bytes

    def bytes_sent(self, rank: int, token_bytes: int) -> int:
        """Bytes ``rank`` sends, for ``token_bytes`` bytes of key plus value per token."""
        return self.send_tokens(rank) * token_bytes

    def total_recv_tokens(self) -> int:
        return sum(self.recv_tokens(r) for r in range(self.world_size))

    def all_gather_tokens(self) -> int:
        """Token slots an all-gather of keys and values would move (every rank receives all other shards)."""
        return sum(self.seq_len - self.shard_len(r) for r in range(self.world_size))

    def imbalance(self) -> float:
        """Max over mean work per rank (1.0 is perfect balance)."""
        mean = sum(self.work) / self.world_size
        return max(self.work) / mean if mean else 1.0

    def summary(self, token_bytes: int = 1) -> str:
        """One line per rank: blocks, work, bytes received/sent, skipped pairs."""
        lines = [f"ContextParallelPlan({self.world_size} ranks, {self.seq_len} tokens, block {self.block_size}, "
                 f"{self.layout}, max/mean work {self.imbalance():.3f})"]
        for r in range(self.world_size):
            lines.append(f"  rank {r}: {len(self.blocks[r])} blocks, work {self.work[r]} tiles, "
                         f"recv {self.bytes_received(r, token_bytes)} B from {list(self.sources(r))}, "
                         f"send {self.bytes_sent(r, token_bytes)} B, skips {list(self.skipped_pairs(r))}")
        return "\n".join(lines)


def _square_block_mask(where: str, block_mask: Any) -> tuple[int, int]:
    """``(seq_len, block_size)`` of a self-attention BlockMask, or a ValueError saying what to change."""
    for name in ("seq_lengths", "BLOCK_SIZE", "kv_num_blocks", "kv_indices"):
        if not hasattr(block_mask, name):
            raise TypeError(f"{where}: block_mask must be a BlockMask (flexc's or torch's), got "
                            f"{type(block_mask).__name__}. Fix: build one with flexc.create_block_mask.")
    L, S = block_mask.seq_lengths
    QB, KB = block_mask.BLOCK_SIZE
    if L != S or QB != KB:
        raise ValueError(f"{where}: context parallelism shards one sequence for queries and keys alike, so the "
                         f"block_mask must be square with equal block sizes; got seq_lengths={(L, S)} and "
                         f"BLOCK_SIZE={(QB, KB)}. Fix: create_block_mask(mask_mod, B, H, N, N, BLOCK_SIZE=n).")
    return L, QB


def _tile_classes(block_mask: Any) -> torch.Tensor:
    """int64 ``[B, H, nQ, nKV]`` tile classes (0 empty, 1 partial, 2 full) of flexc's or torch's BlockMask,
    on the host; remembered while its tables are unmodified (copying a GPU's to the host is a sync,
    and every call of a training loop asks again)."""
    from ..masks.block_mask import BlockMask

    def build() -> torch.Tensor:
        bm = block_mask if isinstance(block_mask, BlockMask) else BlockMask.from_torch(block_mask)
        return bm._tile_classes().cpu()
    return memo_by_tables(block_mask, ("context-parallel tile classes",), build)


def _chunks_by(weights: list[int], parts: int) -> list[int]:
    """Boundaries ``[0, ..., n]`` of ``parts`` contiguous chunks whose sums are as equal as the blocks allow."""
    n, total = len(weights), sum(weights)
    bounds, acc, i = [0], 0, 0
    for k in range(1, parts):
        target = total * k / parts
        # advance while taking the next block brings the running sum closer to the target,
        # leaving at least one block for each chunk still to come
        while i < n - (parts - k) and abs(acc + weights[i] - target) <= abs(acc - target):
            acc += weights[i]
            i += 1
        i = max(i, bounds[-1] + 1)
        acc = sum(weights[:i])
        bounds.append(i)
    bounds.append(n)
    return bounds


def _zigzag(bounds: list[int], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Rank r holds chunks r and 2R-1-r of the 2R chunks delimited by ``bounds``."""
    return tuple(tuple(range(bounds[r], bounds[r + 1])) + tuple(range(bounds[2 * world_size - 1 - r],
                                                                       bounds[2 * world_size - r]))
                 for r in range(world_size))


LAYOUTS = ("auto", "zigzag", "balanced-zigzag", "contiguous")


def plan_context_parallel(block_mask: Any, world_size: int, layout: str = "auto") -> ContextParallelPlan:
    """The sharding and exchange plan of ``block_mask`` over ``world_size`` ranks (no attention compute).

    Query blocks are weighed by their non-empty tiles (over all batches and heads). The sequence is cut
    into 2R chunks, either of equal length or of equal work, and rank r holds chunks r and 2R-1-r; the
    cut with the smaller maximum work wins, equal length on ties. A causal mask therefore gets the
    zig-zag split; documents get chunks of equal document area. Rank r then fetches from rank s the
    key blocks of s that share a non-empty tile with one of r's query blocks.

    ``layout`` forces one split: ``"zigzag"``, ``"balanced-zigzag"``, or ``"contiguous"`` (R chunks of
    equal length in rank order: least traffic for local masks, unbalanced for causal ones).
    """
    where = "plan_context_parallel"
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{where}: world_size must be a positive int, got {world_size!r}.")
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout must be one of {list(LAYOUTS)}, got {layout!r}.")
    L, block = _square_block_mask(where, block_mask)
    nonempty = _tile_classes(block_mask) > 0  # [B, H, nQ, nKV]
    n = nonempty.shape[-2]
    if n < 2 * world_size:
        raise ValueError(f"{where}: the mask has {n} query blocks but {world_size} ranks need at least "
                         f"{2 * world_size} (two chunks per rank). Fix: use a smaller BLOCK_SIZE or fewer ranks.")
    weights = nonempty.sum(dim=(0, 1, 3)).tolist()
    splits = {
        "zigzag": lambda: _zigzag([round(i * n / (2 * world_size)) for i in range(2 * world_size + 1)], world_size),
        "balanced-zigzag": lambda: _zigzag(_chunks_by(weights, 2 * world_size), world_size),
        "contiguous": lambda: tuple(tuple(range(round(r * n / world_size), round((r + 1) * n / world_size)))
                                    for r in range(world_size)),
    }
    names = ("zigzag", "balanced-zigzag") if layout == "auto" else (layout,)
    candidates = []
    for name in names:
        blocks = splits[name]()
        work = tuple(sum(weights[b] for b in bs) for bs in blocks)
        candidates.append((max(work), len(candidates), name, blocks, work))
    _, _, layout, blocks, work = min(candidates)
    owner = torch.empty(n, dtype=torch.int64)
    for r, bs in enumerate(blocks):
        owner[list(bs)] = r
    needed = nonempty.any(dim=0).any(dim=0)  # [nQ, nKV]
    fetch = []
    for r, bs in enumerate(blocks):
        cols = needed[list(bs)].any(dim=0).nonzero().flatten()
        fetch.append(tuple(tuple(int(c) for c in cols if owner[c] == s) if s != r else ()
                           for s in range(world_size)))
    return ContextParallelPlan(world_size, block, L, blocks, work, tuple(fetch), layout)


# ---- sharding -----------------------------------------------------------------------------------

def _rank_and_size(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flexc.call.distributed: torch.distributed is not initialised. Fix: call "
                           "torch.distributed.init_process_group('gloo' or 'nccl', ...) on every rank first.")
    return dist.get_rank(group), dist.get_world_size(group)


def _global_rank(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _check_dim(where: str, x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(x).__name__}.")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{where}: dim={dim} is out of range for a {x.dim()}-d tensor.")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, block_mask: Any, group: Any = None, dim: int = 2,
                   plan: ContextParallelPlan | None = None) -> torch.Tensor:
    """This rank's shard of the full-sequence tensor ``x`` (same on every rank) along ``dim``.

    The shard is the rank's query blocks of :func:`plan_context_parallel` in ascending order (for a
    causal mask: chunks r and 2R-1-r of 2R). Differentiable (an index_select).
    """
    rank, size = _rank_and_size(group)
    plan = plan or plan_context_parallel(block_mask, size)
    dim = _check_dim("shard_sequence", x, dim)
    if x.shape[dim] != plan.seq_len:
        raise ValueError(f"shard_sequence: x has {x.shape[dim]} tokens along dim {dim} but the block_mask "
                         f"covers {plan.seq_len}. Fix: pass the full sequence, or the right dim.")
    return x.index_select(dim, plan.token_index(rank).to(x.device))


def unshard_sequence(x_local: torch.Tensor, block_mask: Any, group: Any = None, dim: int = 2,
                     plan: ContextParallelPlan | None = None) -> torch.Tensor:
    """The full sequence, in order, on every rank, from every rank's shard along ``dim`` (an
    all-gather; not differentiable)."""
    rank, size = _rank_and_size(group)
    plan = plan or plan_context_parallel(block_mask, size)
    dim = _check_dim("unshard_sequence", x_local, dim)
    if x_local.shape[dim] != plan.shard_len(rank):
        raise ValueError(f"unshard_sequence: rank {rank}'s shard has {x_local.shape[dim]} tokens along dim {dim} "
                         f"but the plan gives it {plan.shard_len(rank)}. Fix: pass what shard_sequence returned.")
    longest = max(plan.shard_len(r) for r in range(size))
    moved = x_local.detach().movedim(dim, 0)
    padded = F.pad(moved, (0, 0) * (moved.dim() - 1) + (0, longest - moved.shape[0])).contiguous()
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)  # gloo needs equal sizes: shards travel padded
    full = moved.new_empty((plan.seq_len, *moved.shape[1:]))
    for r in range(size):
        full[plan.token_index(r).to(full.device)] = gathered[r][:plan.shard_len(r)]
    return full.movedim(0, dim)


# ---- the key/value exchange ---------------------------------------------------------------------

def _pad_blocks(x: torch.Tensor, rank_len: int, padded_len: int) -> torch.Tensor:
    """``x [B, H, rank_len, D]`` padded with zero tokens to ``padded_len`` (whole blocks)."""
    return x if rank_len == padded_len else F.pad(x, (0, 0, 0, padded_len - rank_len))


def _block_rows(blocks: list[int] | tuple[int, ...], block_size: int, device: torch.device) -> torch.Tensor:
    """Token rows, in a layout of whole blocks, of the local block positions ``blocks``."""
    base = torch.tensor(list(blocks), dtype=torch.int64, device=device) * block_size
    return (base[:, None] + torch.arange(block_size, device=device)).flatten()


class _Exchange:
    """Posted sends of this rank's key/value blocks and receives of the blocks it fetches."""

    def __init__(self, plan: ContextParallelPlan, rank: int, group: Any, kv: torch.Tensor) -> None:
        self.plan, self.rank, self.group = plan, rank, group
        local = {b: i for i, b in enumerate(plan.blocks[rank])}
        self.send_rows = {r: _block_rows([local[b] for b in plan.fetch[r][rank]], plan.block_size, kv.device)
                          for r in range(plan.world_size) if r != rank and plan.fetch[r][rank]}
        shape = (*kv.shape[:2], 0, kv.shape[-1])
        self.recv = {s: kv.new_empty(shape[:2] + (plan.block_size * len(plan.fetch[rank][s]), shape[-1]))
                     for s in plan.sources(rank)}
        # the backward's gradient exchange, posted by _FetchKV.backward and awaited by _GradsFromPeers
        self.grad_incoming, self.grad_works, self.grad_sends = {}, [], []
        # receives first, then sends: every pair's ops are posted before anyone waits
        self.works = [dist.irecv(buf, src=_global_rank(group, s), group=group) for s, buf in self.recv.items()]
        self.outgoing = {r: kv.index_select(2, rows).contiguous() for r, rows in self.send_rows.items()}
        self.works += [dist.isend(msg, dst=_global_rank(group, r), group=group) for r, msg in self.outgoing.items()]

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.outgoing = {}
        parts = [self.recv[s] for s in sorted(self.recv)]
        return torch.cat(parts, dim=2) if parts else None


class _FetchKV(torch.autograd.Function):
    """Waits for the fetched key/value blocks; backward posts their gradients' way back to the owners
    and the receives of the gradients other ranks send for this rank's blocks, without waiting:
    :class:`_GradsFromPeers` waits, once the local attention's backward has run meanwhile."""

    @staticmethod
    def forward(ctx, kv_local, exchange):
        ctx.exchange = exchange
        ctx.local_shape = kv_local.shape
        remote = exchange.wait()
        if remote is None:  # nothing fetched: an empty tensor keeps this node in the graph
            remote = kv_local.new_zeros((*kv_local.shape[:2], 0, kv_local.shape[-1]))
        return remote

    @staticmethod
    def backward(ctx, grad_remote):
        ex = ctx.exchange
        grad_remote = grad_remote.contiguous()
        sends, offset = [], 0
        for s in sorted(ex.recv):  # the gradient of each fetched block goes back to its owner
            n = ex.recv[s].shape[2]
            sends.append(grad_remote[:, :, offset:offset + n].contiguous())
            offset += n
        ex.grad_incoming = {r: grad_remote.new_empty((*ctx.local_shape[:2], rows.numel(), ctx.local_shape[-1]))
                            for r, rows in ex.send_rows.items()}
        ex.grad_works = [dist.irecv(buf, src=_global_rank(ex.group, r), group=ex.group)
                         for r, buf in ex.grad_incoming.items()]
        ex.grad_sends = sends  # (alive until the sends complete)
        ex.grad_works += [dist.isend(g, dst=_global_rank(ex.group, s), group=ex.group)
                          for s, g in zip(sorted(ex.recv), sends)]
        return None, None


class _GradsFromPeers(torch.autograd.Function):
    """Identity on this rank's keys and values, applied before the local attention and the fetch read
    them; its backward runs after both backwards (autograd runs the fetch's first, it was recorded
    later) and adds the gradients the peers sent, so the exchange overlaps the local backward."""

    @staticmethod
    def forward(ctx, kv_local, exchange):
        ctx.exchange = exchange
        return kv_local.view_as(kv_local)

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.exchange
        for w in ex.grad_works:
            w.wait()
        ex.grad_works, ex.grad_sends = [], []
        for r, buf in ex.grad_incoming.items():
            grad = grad.index_add(2, ex.send_rows[r], buf)
        ex.grad_incoming = {}
        return grad, None


class _SumGradAcrossRanks(torch.autograd.Function):
    """Identity; the backward all-reduces the gradient, so a captured tensor replicated on every rank
    receives the gradient of the whole sequence, as in a single process."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# ---- attention ----------------------------------------------------------------------------------

def _sub_block_mask(classes: torch.Tensor, rows: list[int], cols: list[int], ragged: int | None,
                    block_size: int, mask_mod: Callable):
    """A flexc BlockMask over the compact layout ``rows x cols`` (global block indices) of ``classes``."""
    from ..masks.block_mask import BlockMask

    sub = classes[:, :, rows][:, :, :, cols].clone()
    if ragged is not None:  # tiles holding padding run the mask_mod, which rejects the padding
        for axis, where in ((2, rows), (3, cols)):
            if ragged in where:
                sel = sub.select(axis, where.index(ragged))
                sel[sel == FULL] = PARTIAL
    partial = dense_to_ordered(sub == PARTIAL)
    full = dense_to_ordered(sub == FULL)
    n = (len(rows) * block_size, len(cols) * block_size)
    return BlockMask.from_kv_blocks(*partial, *full, BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=n)


def _positions(plan: ContextParallelPlan, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Global position (0 for padding) and validity of each token slot of ``blocks`` laid out whole."""
    pos = (torch.tensor(blocks, dtype=torch.int64)[:, None] * plan.block_size
           + torch.arange(plan.block_size)).flatten()
    valid = pos < plan.seq_len
    return torch.where(valid, pos, 0), valid


def _global_mods(score_mod, mask_mod, q_pos, q_valid, kv_pos, kv_valid, padded: bool):
    """Mods on the compact layout that call the user's mods on global indices."""
    user_mask = mask_mod if mask_mod is not noop_mask else None

    def mask(b, h, q_idx, kv_idx):
        keep = kv_valid[kv_idx] & q_valid[q_idx]
        if user_mask is None:
            return keep
        return user_mask(b, h, q_pos[q_idx], kv_pos[kv_idx]) & keep

    def plain_mask(b, h, q_idx, kv_idx):
        return user_mask(b, h, q_pos[q_idx], kv_pos[kv_idx])

    def score(s, b, h, q_idx, kv_idx):
        return score_mod(s, b, h, q_pos[q_idx], kv_pos[kv_idx])

    chosen_mask = mask if padded else (plain_mask if user_mask is not None else noop_mask)
    return (score if score_mod is not None else None), chosen_mask


def _with_buffers(score_mod: Callable | None, replaced: dict[int, torch.Tensor]):
    """The traced ``score_mod`` with captured tensors swapped by identity (for the gradient all-reduce),
    also where the mod computes from them (``torch.exp(w)``: the computation reads the swapped ``w``)."""
    if score_mod is None or not replaced:
        return score_mod
    return derived.current(trace(score_mod, SCORE_MOD), substitute=replaced)


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partial attentions over disjoint keys merged by logsumexp; rows dead in both stay 0 / -inf
    with finite gradients."""
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isneginf(m), 0.0, m)
    wa, wb = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
    total = wa + wb
    alive = total > 0
    total_safe = torch.where(alive, total, 1.0)
    lse = torch.where(alive, m_safe + torch.log(total_safe), -math.inf)
    out = (out_a * (wa / total_safe)[..., None].to(out_a.dtype)
           + out_b * (wb / total_safe)[..., None].to(out_b.dtype))
    return out, lse


def _shared_dropout(dropout_p: float, generator: Any, group: Any, like: torch.Tensor) -> dropout.Dropout:
    """The call's dropout with one seed for all ranks: each draws one (as a single call advances its
    generator), rank 0's is broadcast (on ``like``'s device, which NCCL needs)."""
    seed = dropout.seed_tensor(generator).to(like.device)
    dist.broadcast(seed, src=_global_rank(group, 0), group=group)
    return dropout.from_seed(dropout_p, seed)  # (on the device: reading it would sync)


def flex_attention(q_local: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor,
                   score_mod: Callable | None = None, block_mask: Any = None, *, group: Any = None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: dict | None = None, plan: ContextParallelPlan | None = None,
                   sinks: torch.Tensor | None = None, dropout_p: float = 0.0, generator: torch.Generator | None = None):
    """:func:`flexc.flex_attention` over a sequence sharded across the ranks of ``group``.

    Args:
        q_local, k_local, v_local: this rank's shards ``[B, H, n_local, D]`` from :func:`shard_sequence`.
        score_mod: as in :func:`flexc.flex_attention`; sees global ``q_idx``/``kv_idx``. Captured float
            tensors must be the same on every rank; their gradients are summed over the ranks.
        block_mask: the BlockMask of the *full* sequence (square, equal block sizes); required, since
            it decides the sharding and the exchange.
        group: the process group (default: the world).
        scale, enable_gqa, kernel_options: as in :func:`flexc.flex_attention`.
        return_lse: also return this rank's logsumexp ``[B, Hq, n_local]``.
        plan: a :func:`plan_context_parallel` result for this mask and group size, to skip re-planning.
        sinks: attention-sink logits as in :func:`flexc.flex_attention` (the same on every rank; their
            gradient is summed over the ranks), folded once into each row's softmax: into the rank's own
            partial attention, before the logsumexp merge with the remote blocks' part.
        dropout_p, generator: attention dropout as in :func:`flexc.flex_attention`. Every rank draws
            a seed from its ``generator`` (each advances as a single call's would) and uses rank 0's,
            broadcast: each (q_idx, kv_idx) pair is drawn at its global position from that one seed,
            so the ranks together drop what one process drops with rank 0's generator state.

    Returns:
        ``out_local [B, Hq, n_local, Ev]`` (and ``lse_local``), the rows of this rank's queries.

    Every rank must call this collectively, and, when training, run backward through its output: the
    backward exchanges key/value gradients between the ranks.
    """
    where = "flexc.call.distributed.flex_attention"
    if block_mask is None:
        raise ValueError(f"{where}: block_mask is required: context parallelism is planned from it. Fix: pass "
                         f"create_block_mask(mask_mod, B, H, N, N) of the full sequence (noop_mask allows all).")
    dropout_p = dropout.check(dropout_p, generator, where)
    rank, size = _rank_and_size(group)
    plan = plan or plan_context_parallel(block_mask, size)
    if plan.world_size != size:
        raise ValueError(f"{where}: plan is for {plan.world_size} ranks but the group has {size}. Fix: "
                         f"plan_context_parallel(block_mask, {size}).")
    n_local = plan.shard_len(rank)
    for name, t in (("q_local", q_local), ("k_local", k_local), ("v_local", v_local)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{where}: {name} must be a 4-d tensor [B, H, n_local, D], got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}.")
        if t.shape[2] != n_local:
            raise ValueError(f"{where}: {name} has {t.shape[2]} tokens but rank {rank}'s shard has {n_local}. "
                             f"Fix: pass shard_sequence(x, block_mask) of the full sequence.")
    if scale is None:
        scale = 1.0 / math.sqrt(q_local.shape[-1])
    drop = _shared_dropout(dropout_p, generator, group, q_local) if dropout_p else None
    bs, mine = plan.block_size, list(plan.blocks[rank])
    ragged = plan.num_blocks - 1 if plan.seq_len % bs else None
    padded_len = bs * len(mine)
    classes = _tile_classes(block_mask)
    mask_mod = getattr(block_mask, "mask_mod", None) or noop_mask

    # this rank's keys and values, whole blocks, as one tensor so each peer gets one message
    E = k_local.shape[-1]
    kv = torch.cat([_pad_blocks(k_local, n_local, padded_len), _pad_blocks(v_local, n_local, padded_len)], dim=-1)
    exchange = _Exchange(plan, rank, group, kv.detach())
    kv = _GradsFromPeers.apply(kv, exchange)
    q = _pad_blocks(q_local, n_local, padded_len)

    # captured tensors that train: one all-reduce each, shared by both partial calls
    replaced = {}
    if score_mod is not None:
        for t in derived.sources(trace(score_mod, SCORE_MOD)):
            if t.is_floating_point() and t.requires_grad and torch.is_grad_enabled():
                replaced[id(t)] = _SumGradAcrossRanks.apply(t, group)

    q_pos, q_valid = _positions(plan, mine)
    padded = ragged is not None

    # the sinks join the softmax once: folded into this rank's own partial attention (their gradient
    # summed over the ranks, as every rank's rows see the same sinks)
    rows = None
    if sinks is not None:
        rows = check_sinks(sinks, q_local, where)
        if rows.requires_grad and torch.is_grad_enabled():
            rows = _SumGradAcrossRanks.apply(rows, group)

    def partial(k, v, cols, sink_rows=None):
        kv_pos, kv_valid = _positions(plan, cols)
        q_at, kv_at = q_pos.to(q.device), kv_pos.to(q.device)
        smod, mmod = _global_mods(score_mod, mask_mod, q_at, q_valid.to(q.device), kv_at, kv_valid.to(q.device),
                                  padded)
        sub = _sub_block_mask(classes, mine, cols, ragged, bs, mmod).to(q.device)
        # (dropout: the pairs at their global positions, as the mods see them)
        at = drop._replace(q_positions=q_at, kv_positions=kv_at) if drop is not None else None
        return _attention.attend(q, k, v, _with_buffers(smod, replaced), sub, scale, enable_gqa, True,
                                 kernel_options, None, at, sink_rows)

    # attention over this rank's own blocks runs while the remote blocks are in flight
    out, lse = partial(kv[..., :E], kv[..., E:], mine, rows)
    remote = _FetchKV.apply(kv, exchange)
    remote_blocks = [b for s in sorted(exchange.recv) for b in plan.fetch[rank][s]]
    if remote_blocks:
        out_r, lse_r = partial(remote[..., :E], remote[..., E:], remote_blocks)
        out, lse = _merge(out, lse, out_r, lse_r)
    else:
        # keeps the exchange in the graph: its backward receives the gradients of this rank's
        # blocks that other ranks read, and must run even when this rank reads none of theirs
        out = out + remote.sum().to(out.dtype)
    out = out[:, :, :n_local]
    lse = lse[:, :, :n_local]
    return (out, lse) if return_lse else out
