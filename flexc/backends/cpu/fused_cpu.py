"""Forward query rows on torch's fused CPU flash-attention kernel.

``aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=, scale=)`` scores, softmaxes
and multiplies by ``V`` in cache-sized tiles in one C++ pass, as ``torch.compile`` does; the
plain-torch path (:func:`flexc.backends.cpu.torch_cpu._forward_row`) makes five or more passes over
each score tile. Each query row range becomes a few kernel calls whose outputs are merged with
their logsumexps:

* without a score_mod, one call over all *full* key blocks with no mask, and calls over the
  *partial* blocks with an additive float mask (0 allowed, -inf blocked) from the mask_mod;
* with a score_mod ``score +/- X`` (ALiBi, relative and learned biases), calls over all listed
  blocks with ``+/-X`` (and -inf on blocked pairs) as the additive mask, a bounded number of
  columns at a time. The kernel adds the mask after scaling, exactly where a score_mod applies.

Two refinements: consecutive rows that share full key blocks (a causal prefix) attend to them in
one tall call (the kernel is faster on tall queries), over a binary tree of the rows; and a bias
or mask proven on the IR to read positions only through ``kv - q`` is evaluated once per
difference and passed as a strided (Toeplitz) view instead of an ``r x c`` tile.

Learned attention sinks (flexc's ``sinks=``) join the merge as one more part, with output 0 and
logsumexp the sink's logit (:func:`fold_sink`): the kernel itself has no softmax state to start from.

Fully masked rows come back from the kernel with logsumexp 0; they are set to -inf. Other
score_mods, differing value head dims, half precision (the kernel would round each part's
output) and ``max_scores`` stay on the plain-torch path.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from ...device import is_plain_cpu
from ...mods.evaluate import evaluate
from .block_plan import Chunk, add_chunk_rows, chunk_kv_index, chunk_rows, fused_pieces, shared_full_columns, tree_calls

# guarded: older or trimmed torch builds may lack the op. Its Python binding (an unboxed call), else
# the overload itself, not its packet: the packet's Python dispatch cost ~20 us a call, which
# decoding pays every token, and the overload's boxed call still a few
FLASH = (getattr(torch, "_scaled_dot_product_flash_attention_for_cpu", None)
          or getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None), "default", None))
FLASH_BACKWARD = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None),
                         "default", None)
_NEG_INF = float("-inf")
# An additive mask holds at most this many elements (2 MiB in fp32) per call
MASK_ELEMENTS = 1 << 19
# Scores per row worker below which one thread (with the kernel's own threads) is faster; at
# L=1024, H=8 causal (~5M scores) two workers were already 5-10% faster on 2 cores
MIN_COST_PER_WORKER = 2e6


def supported(query: torch.Tensor, value: torch.Tensor, mods, need_max: bool) -> bool:
    """Whether the fused kernel computes this forward exactly as the plain-torch path would
    (``mods`` None: attention without mods)."""
    return (FLASH is not None and not need_max and is_plain_cpu(query.device)
            and query.dtype in (torch.float32, torch.float64)
            and query.shape[-1] == value.shape[-1]
            and (mods is None or mods.score_mod is None or mods.bias_node is not None))


def heads_folded(t: torch.Tensor) -> torch.Tensor:
    """A row-major ``[B, H, n, E]`` tensor as the kernel's batch of one head, ``[B * H, 1, n, E]`` (a
    view): the kernel's outputs and gradients then come back row-major."""
    return t.view(t.shape[0] * t.shape[1], 1, *t.shape[2:])


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with stride 1 along its last dimension (a copy only when needed): the fused kernel
    misreads any other last-dim stride (channels_last, ``v[..., ::2]``, permuted views)."""
    return t if t.stride()[-1] == 1 or t.shape[-1] <= 1 else t.contiguous()


@functools.lru_cache(maxsize=4096)
def _pieces(segments: tuple, max_masked_cols: int, mode: str) -> tuple[Chunk, ...]:
    return fused_pieces(segments, max_masked_cols, mode)


_DIFFERENCE_OPS = {"sub", "eq", "ne", "lt", "le", "gt", "ge"}


@functools.lru_cache(maxsize=256)
def _relative_only(node) -> bool:
    """Whether ``q_idx`` and ``kv_idx`` reach ``node`` only as ``kv_idx - q_idx``, ``q_idx - kv_idx``
    or a comparison of the two,
    so its value over a tile depends on each position only through ``kv - q`` (and b, h)."""
    if node.op in _DIFFERENCE_OPS and all(a.op == "input" for a in node.args) and \
            sorted(a.attr for a in node.args) == ["kv_idx", "q_idx"]:
        return True  # q - kv, kv - q, and comparisons of q with kv (the sign of q - kv)
    if node.op == "input":
        return node.attr not in ("q_idx", "kv_idx")
    return all(_relative_only(a) for a in node.args)


def _mode(g, mods) -> str:
    """How bias and mask reach the kernel: "mask" (no score_mod), "relative" or "bias" (see fused_pieces)."""
    if mods.bias_node is None:
        return "mask"
    return "relative" if g.G == 1 and _relative_only(mods.bias_node) else "bias"


def group_tasks(tasks: list, n_workers: int) -> tuple[list, list]:
    """Row tasks ``(g, mods, row)`` regrouped as ``(g, mods, rows)`` runs of consecutive rows, and
    their costs. Runs have up to a power of two rows (at most 8) that leaves four tasks per worker.
    A row joins a run only if at least half its keys are full for the run's first row too (else
    there is no tall call to share: sliding windows). GQA or a general bias keep one row a task."""
    size = 1
    # at most 8 rows: each task holds its rows' output twice or so (tall parts and their sum)
    while len(tasks) // (2 * size) >= 4 * n_workers and size < 8:
        size *= 2
    out: list = []
    for g, mods, row in tasks:
        last = out[-1] if out else None
        if (size > 1 and last is not None and last[0] is g and len(last[2]) < size
                and last[2][-1].q1 == row.q0 and g.G == 1 and _mode(g, mods) != "bias"
                and 2 * shared_full_columns(last[2][0], row) >= sum(b - a for a, b, _ in row.segments)):
            last[2].append(row)
        else:
            out.append((g, mods, [row]))
    grouped = [(g, mods, tuple(rows)) for g, mods, rows in out]
    costs = [float(sum((r.q1 - r.q0) * sum(b - a for a, b, _ in r.segments) for r in rows)
                   * len(range(g.b.stop)[g.b]) * len(range(g.qh.stop)[g.qh])) for g, _, rows in grouped]
    return grouped, costs


def _group_calls(key, value, g, mods, Bg: int, Hqg: int, r: int) -> tuple:
    """``(k_g, v_g, mode, relative_mask, max_cols)`` for the kernel calls of group ``g`` over ``r``
    query rows: its keys and values (a key batch broadcast over the query batches as the kernel's
    stride-0 view), how bias and mask reach the kernel (:func:`_mode`), whether the mask is built
    from ``kv - q`` alone (:func:`_relative_tile`), and the widest call's column count."""
    k_g, v_g = key[g.kb, g.kvh], value[g.kb, g.kvh]
    if k_g.shape[0] != Bg:
        k_g, v_g = k_g.expand(Bg, *k_g.shape[1:]), v_g.expand(Bg, *v_g.shape[1:])
    mode = _mode(g, mods)
    relative_mask = (g.G == 1 and mode != "bias"
                     and (mods.mask_mod is None or _relative_only(mods.mask_mod.root)))
    # masks are [r, c] unless the mods read b or h; keep each call's mask within MASK_ELEMENTS
    per_col = r * ((Bg * Hqg) if (mods.bias_reads | mods.mask_reads) & {"b", "h"} else 1)
    return k_g, v_g, mode, relative_mask, max(MASK_ELEMENTS // per_col, 128)


def forward_rows(query, key, value, out, lse, g, rows: tuple, mods, scale: float,
                 sinks: torch.Tensor | None = None) -> None:
    """Consecutive rows of group ``g``: fused kernel calls merged by logsumexp into out/lse, with the
    rows' ``sinks`` (``[B or 1, Hq, 1]``) as one more part of the merge."""
    q0, q1 = rows[0].q0, rows[-1].q1
    Bg, Hqg, E = len(range(out.shape[0])[g.b]), len(range(out.shape[1])[g.qh]), query.shape[-1]
    Hkvg = Hqg // g.G
    k_g, v_g, mode, relative_mask, max_cols = _group_calls(key, value, g, mods, Bg, Hqg, rows[0].q1 - rows[0].q0)
    if len(rows) == 1:
        calls = [(q0, q1, piece) for piece in _pieces(rows[0].segments, max_cols, mode)]
    else:  # G == 1 here, so rows of the group are rows of the stacked layout
        calls = tree_calls(rows, max_cols, mode)
    acc = acc_lse = None
    if len(rows) > 1:
        acc = torch.zeros(Bg, Hkvg, g.G * (q1 - q0), E, dtype=query.dtype, device=query.device)
        acc_lse = torch.full(acc.shape[:-1], _NEG_INF, dtype=query.dtype, device=query.device)
    for a, b, piece in calls:
        q = query[g.b, g.qh, a:b].reshape(Bg, Hkvg, g.G * (b - a), E)  # GQA: a key head's query heads as rows
        kc, vc = chunk_rows(k_g, piece), chunk_rows(v_g, piece)
        mask, reversed_rows = _call_mask(q, mods, a, b, piece, mode, relative_mask, g.G)
        o, l = FLASH(q.flip(-2) if reversed_rows else q, kc, vc, attn_mask=mask, scale=scale)
        if mask is not None:
            fix_dead_rows(l, mask)  # (rows in the mask's order)
        if reversed_rows:  # the tile is a strided view laid out for the query rows in reverse
            o, l = o.flip(-2), l.flip(-1)
        if acc is None:
            acc, acc_lse = o, l
        elif len(rows) == 1:  # every call covers all the rows (stacked G*r of them with GQA)
            _merge(acc, acc_lse, o, l)
        else:
            _merge(acc[..., a - q0:b - q0, :], acc_lse[..., a - q0:b - q0], o, l)
    if sinks is not None:  # the sink: a part with output 0 and logsumexp its logit
        sink = group_sinks(sinks, g, Bg, q1 - q0).to(acc_lse.dtype).reshape(acc_lse.shape)
        _merge(acc, acc_lse, torch.zeros((), dtype=acc.dtype, device=acc.device), sink)
    out[g.b, g.qh, q0:q1] = acc.reshape(Bg, Hqg, q1 - q0, E)  # the kernel returns [b, r, h, E] strides
    # a +inf score (a +inf bias) gives the kernel's logsumexp +inf; the output is NaN, and so is
    # the lse on every other path (exp(inf - inf)), as in torch's kernels
    acc_lse = acc_lse.reshape(Bg, Hqg, q1 - q0)
    lse[g.b, g.qh, q0:q1] = acc_lse.masked_fill(acc_lse.isposinf(), float("nan"))


def backward_supported(query, value, mods, grad_lse, grad_slots) -> bool:
    """Whether :func:`backward_row` gives this backward: the forward's fused case (no dropout; a
    score_mod only as a bias, with no captured tensor wanting a gradient) and no gradient into the
    logsumexp (torch's fused backward takes ``delta = rowsum(dO * out)`` alone). Finite inputs and
    a present backward op are the caller's and this module's checks."""
    return (FLASH_BACKWARD is not None and supported(query, value, mods, False) and mods.dropout is None
            and not grad_slots and (grad_lse is None or not bool(grad_lse.any())))


def backward_row(query, key, value, out, lse, grad_out, dq, dk, dv, g, row, mods, scale: float) -> None:
    """The gradients of one row task of group ``g``, added into ``dq``, ``dk`` and ``dv`` (fp32 or
    fp64, the inputs' layout): torch's fused backward over each of the forward's kernel calls, with
    the same additive masks, the rows' final output and logsumexp (the calls' gradients then add up
    as their shares of the softmax do). ``lse`` is the saved one with -inf (rows that allow nothing)
    made +inf, so their probabilities, and gradients, are 0."""
    Bg, Hqg, E = len(range(out.shape[0])[g.b]), len(range(out.shape[1])[g.qh]), query.shape[-1]
    Hkvg, q0, q1 = Hqg // g.G, row.q0, row.q1
    k_g, v_g, mode, relative_mask, max_cols = _group_calls(key, value, g, mods, Bg, Hqg, q1 - q0)
    dk_g, dv_g = dk[g.kb, g.kvh], dv[g.kb, g.kvh]
    broadcast_kv = dk_g.shape[0] != Bg  # (k_g is the broadcast view then: its gradients sum over batch)
    stacked = lambda t: t[g.b, g.qh, q0:q1].reshape(Bg, Hkvg, g.G * (q1 - q0), *t.shape[3:])
    q, o, go, l = stacked(query), stacked(out), stacked(grad_out), stacked(lse)
    dq_rows = torch.zeros(q.shape, dtype=dq.dtype, device=dq.device)
    with denormals_flushed() if mode != "mask" else contextlib.nullcontext():
        _backward_calls(q, k_g, v_g, o, go, l, dq_rows, dk_g, dv_g, broadcast_kv, g, row, mods, scale, mode,
                        relative_mask, max_cols)
    dq[g.b, g.qh, q0:q1] += dq_rows.view(Bg, Hqg, q1 - q0, E)


def backward_rows(query, key, value, out, lse, grad_out, dq, dk, dv, g, rows: tuple, mods, scale: float) -> None:
    """:func:`backward_row` for a run of consecutive rows of group ``g`` (:func:`group_tasks`: one query
    head per key head): the forward's tall calls over key spans full for several rows
    (:func:`tree_calls`) are fewer and taller backward calls too (L=2048 keys, 1024 query rows, 8
    heads, one thread: 167 ms in calls of 128 rows, 113 ms in calls of 512)."""
    if len(rows) == 1:
        return backward_row(query, key, value, out, lse, grad_out, dq, dk, dv, g, rows[0], mods, scale)
    Bg, Hqg = len(range(out.shape[0])[g.b]), len(range(out.shape[1])[g.qh])
    q0, q1 = rows[0].q0, rows[-1].q1
    k_g, v_g, mode, relative_mask, max_cols = _group_calls(key, value, g, mods, Bg, Hqg, rows[0].q1 - rows[0].q0)
    dk_g, dv_g = dk[g.kb, g.kvh], dv[g.kb, g.kvh]
    broadcast_kv = dk_g.shape[0] != Bg
    dq_rows = torch.zeros(Bg, Hqg, q1 - q0, query.shape[-1], dtype=dq.dtype, device=dq.device)
    with denormals_flushed() if mode != "mask" else contextlib.nullcontext():
        for a, b, piece in tree_calls(rows, max_cols, mode):
            q, o, go = (t[g.b, g.qh, a:b] for t in (query, out, grad_out))
            l = lse[g.b, g.qh, a:b]
            kc, vc = chunk_rows(k_g, piece), chunk_rows(v_g, piece)
            mask, reversed_rows = _call_mask(q, mods, a, b, piece, mode, relative_mask, 1)
            if reversed_rows:  # the tile is laid out for the rows in reverse (_relative_tile)
                go, q, o, l = go.flip(-2), q.flip(-2), o.flip(-2), l.flip(-1)
            gq, gk, gv = FLASH_BACKWARD(go, q, kc, vc, o, l, 0.0, False, attn_mask=mask, scale=scale)
            dq_rows[..., a - q0:b - q0, :] += gq.flip(-2) if reversed_rows else gq
            add_chunk_rows(dk_g, piece, gk, broadcast_kv)
            add_chunk_rows(dv_g, piece, gv, broadcast_kv)
    dq[g.b, g.qh, q0:q1] += dq_rows


def _backward_calls(q, k_g, v_g, o, go, l, dq_rows, dk_g, dv_g, broadcast_kv: bool, g, row, mods, scale: float,
                    mode: str, relative_mask: bool, max_cols: int) -> None:
    """The fused backward over each of the row's kernel calls (:func:`backward_row`)."""
    q0, q1 = row.q0, row.q1
    flipped = None  # the rows' inputs in reverse order, made once for the row's reversed tiles
    for piece in _pieces(row.segments, max_cols, mode):
        kc, vc = chunk_rows(k_g, piece), chunk_rows(v_g, piece)
        mask, reversed_rows = _call_mask(q, mods, q0, q1, piece, mode, relative_mask, g.G)
        if reversed_rows:
            # as the forward: the rows run reversed on the strided tile, whose copy (r x c a head)
            # costs more than the rows' (r x E, and dq's flip back)
            if flipped is None:
                flipped = (go.flip(-2), q.flip(-2), o.flip(-2), l.flip(-1))
            gq, gk, gv = FLASH_BACKWARD(flipped[0], flipped[1], kc, vc, flipped[2], flipped[3], 0.0, False,
                                        attn_mask=mask, scale=scale)
            gq = gq.flip(-2)
        else:
            gq, gk, gv = FLASH_BACKWARD(go, q, kc, vc, o, l, 0.0, False, attn_mask=mask, scale=scale)
        dq_rows += gq
        add_chunk_rows(dk_g, piece, gk, broadcast_kv)
        add_chunk_rows(dv_g, piece, gv, broadcast_kv)


def _flushing() -> bool:
    """Whether this thread flushes subnormal floats to zero (torch has a setter, no getter)."""
    return bool(torch.full((1,), 1e-38) * 1e-3 == 0)


@contextlib.contextmanager
def denormals_flushed():
    """This thread's float arithmetic with subnormals flushed to zero, then as it was.

    The fused backward recomputes ``exp(s + bias - lse)``; a bias far below the row's scores
    (ALiBi's far keys) puts it among subnormals or past exp's underflow, where the kernel's
    arithmetic runs 3-40x slower (ALiBi causal, L=1024, one thread: 95 ms -> 36 ms). The values
    flushed are below 1.2e-38 of a probability. (Only this thread: the kernel must run with one
    thread, as flexc's row workers do.)"""
    if _flushing():
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


# A relative call's tile is copied out (no row flips) when its elements are at most this many times
# the query's (the flip path copies the query rows and the output, r x E each per head)
TILE_COPY_RATIO = 2.0


def _call_mask(q, mods, q0: int, q1: int, piece: Chunk, mode: str, relative_mask: bool, G: int):
    """``(mask, reversed_rows)``: the additive mask of one kernel call over ``piece`` for query rows
    ``[q0, q1)`` (``q`` their stacked rows), or None; ``reversed_rows`` when it is laid out for
    the rows in reverse order (:func:`_relative_tile`)."""
    if relative_mask and len(piece.spans) == 1 and (piece.partial or mode == "relative"):
        return _relative_tile(q, mods, q0, q1, piece, mode == "relative")
    kv = chunk_kv_index(piece, mods.kv_pos)
    return _mask(piece, mods, q0, q1, kv, mode != "mask", q.dtype, G), False


def _relative_tile(q, mods, q0: int, q1: int, piece: Chunk, bias: bool) -> tuple[torch.Tensor, bool]:
    """The additive mask of one kernel call over the contiguous key span of ``piece`` when it (the
    bias, and the mask_mod on its partial columns) depends on positions only through ``kv - q``,
    and whether it is laid out for the query rows in reverse.

    The mask is evaluated once per difference (``r + c - 1`` values, not ``r * c``). Entry ``(i, j)``
    of the ``[r, c]`` tile is then ``vector[r - 1 - i + j]``: with the query rows reversed it is
    ``vector[i + j]``, a strided view of the vector, and the kernel runs on the reversed rows (its
    output flipped back). When the tile is no bigger than the query rows and the output (a short,
    wide call: a sliding window), or must be copied anyway to unmask the full columns of a piece that
    mixes full and partial blocks, it is instead copied out in the right row order (a window view of
    the vector, rows reversed) and the rows stay as they are: one copy instead of two flips.
    """
    start, end = piece.spans[0]
    r, c = q1 - q0, end - start
    diffs = torch.arange(start - (q1 - 1), end - q0, device=q.device)  # kv - q from the last row up
    values = {"b": mods.b, "h": mods.h, "q_idx": torch.zeros((1, 1, 1, 1), dtype=diffs.dtype, device=q.device),
              "kv_idx": diffs.view(1, 1, 1, -1)}
    at = lambda reads: {name: values[name] for name in reads if name in values}
    vec = torch.zeros((), dtype=q.dtype, device=q.device)
    if bias:
        vec = evaluate(mods.bias_node, clamp_lookups=True, buffers=mods.score_mod.buffers,
                       **at(mods.bias_reads)).to(q.dtype)
        if mods.bias_sign < 0:
            vec = vec.neg()
    if piece.partial and mods.mask_mod is not None:
        allowed = evaluate(mods.mask_mod, clamp_lookups=True, **at(mods.mask_reads))
        vec = torch.where(allowed, vec, _NEG_INF)
    vec = vec.reshape((1,) * (4 - vec.dim()) + tuple(vec.shape))
    n = r + c - 1
    vec = vec.expand(vec.shape[0], vec.shape[1], 1, n)
    full = _full_columns(piece) if piece.partial and mods.mask_mod is not None and not bias else []
    if full or vec.shape[0] * vec.shape[1] * c <= TILE_COPY_RATIO * q.shape[0] * q.shape[1] * q.shape[-1]:
        # row i of the tile is the window vector[r - 1 - i : r - 1 - i + c]; flip copies
        tile = vec.unfold(-1, c, 1).squeeze(2).flip(-2)
        for off, length in full:  # full blocks are allowed whatever the mask_mod says
            tile[..., off:off + length] = 0.0
        return tile, False
    vec = vec.contiguous()
    return vec.as_strided((vec.shape[0], vec.shape[1], r, c), (vec.shape[1] * n, n, 1, 1)), True


def _full_columns(piece: Chunk) -> list[tuple[int, int]]:
    """``(offset, length)`` column ranges of the piece that are not partial."""
    out, pos = [], 0
    for off, length in piece.partial:
        if off > pos:
            out.append((pos, off - pos))
        pos = off + length
    if pos < piece.n_cols:
        out.append((pos, piece.n_cols - pos))
    return out


def _mask(piece: Chunk, mods, q0: int, q1: int, kv: torch.Tensor, bias: bool, dtype: torch.dtype, G: int):
    """The additive mask of one call, shaped ``[b, h, G*r, c]`` for the row-stacked query, or None."""
    blocked = mods.blocked(piece, q0, q1, kv)
    if not bias and not blocked:
        return None
    r = q1 - q0
    if bias and not blocked:  # the evaluated bias itself (read-only here), broadcast
        x = mods.bias(q0, q1, kv).to(dtype)
        if mods.bias_sign < 0:
            x = x.neg()
        x = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
        return stack_heads(x.expand(x.shape[0], x.shape[1], r, piece.n_cols), G)
    parts = [nb for _, _, nb in blocked]
    if bias:
        x = mods.bias(q0, q1, kv)
        parts.append(x)
    # batch and head extent of the mask: those of any part that has them (parts are broadcastable)
    b = max((t.shape[0] for t in parts if t.dim() == 4), default=1)
    h = max((t.shape[1] for t in parts if t.dim() == 4), default=1)
    if bias:
        mask = torch.empty(b, h, r, piece.n_cols, dtype=dtype, device=kv.device)
        mask.copy_(x if mods.bias_sign > 0 else -x)  # broadcasts and casts
    elif len(blocked) == 1 and blocked[0][1] == piece.n_cols:  # the common case: one tile, all partial
        return stack_heads(torch.zeros(b, h, r, piece.n_cols, dtype=dtype, device=kv.device)
                            .masked_fill_(blocked[0][2], _NEG_INF), G)
    else:
        mask = torch.zeros(b, h, r, piece.n_cols, dtype=dtype, device=kv.device)
    for off, n, not_allowed in blocked:
        mask[..., off:off + n].masked_fill_(not_allowed, _NEG_INF)
    return stack_heads(mask, G)


def stack_heads(mask: torch.Tensor, G: int) -> torch.Tensor:
    """``[b, h, r, c]`` as ``[b, h/G or 1, G*r, c]``: rows of a key head's G query heads follow one another."""
    if G == 1:
        return mask
    b, h, r, c = mask.shape
    if h == 1:
        mask = mask.expand(b, G, r, c)
    return mask.reshape(b, -1, G * r, c)


def fix_dead_rows(l: torch.Tensor, mask: torch.Tensor) -> None:
    """The kernel reports logsumexp 0 (and output 0) for rows its mask blocks entirely: make it -inf.

    A real logsumexp of exactly 0 is rare, so the mask is only inspected when one occurs.
    """
    candidates = l == 0
    if bool(candidates.any()):
        dead = torch.isneginf(mask).all(-1).expand(l.shape)
        l.masked_fill_(candidates & dead, _NEG_INF)


def group_sinks(sinks: torch.Tensor, g, Bg: int, r: int) -> torch.Tensor:
    """The sink logits of group ``g``'s rows, ``[Bg, Hq_g, r]`` (a broadcast view), from the call's
    ``[B or 1, Hq, 1]`` (:func:`flexc.call.sinks.check_sinks`)."""
    rows = sinks if sinks.shape[0] == 1 else sinks[g.b]
    rows = rows[:, g.qh]
    return rows.expand(Bg, rows.shape[1], r)


def fold_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of finished rows (``[B, Hq, L, Ev]``, ``[B, Hq, L]``) with the rows' sink logits
    ``sinks`` (``[B or 1, Hq, 1]``) joined as one more part of their softmax, with output 0 (the
    merge :func:`_merge` of the rows' parts): the fold of the paths whose softmax ends inside
    torch's fused kernel, which has no state to start from. A -inf sink changes nothing; a row with
    nothing allowed gets output 0 and lse the sink."""
    acc, acc_lse = out.to(lse.dtype, copy=True), lse.clone()
    _merge(acc, acc_lse, torch.zeros((), dtype=acc.dtype, device=acc.device), sinks.to(lse.dtype).expand_as(lse))
    return acc.to(out.dtype), acc_lse


def _merge(acc: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """Fold a part ``(o, l)`` into the running ``(acc, acc_lse)`` in place (softmax-weighted mean)."""
    m = torch.maximum(acc_lse, l)
    m.masked_fill_(m == _NEG_INF, 0.0)  # both parts empty: weights exp(-inf) = 0, lse stays -inf
    w_acc = (acc_lse - m).exp_()
    w_new = (l - m).exp_()
    total = w_acc + w_new
    acc.lerp_(o, (w_new / total.masked_fill(total == 0, 1.0)).unsqueeze(-1))
    torch.add(m, total.log_(), out=acc_lse)
