"""Calls after a tensor got other contents without moving its version counter (``.data = new``,
``vector_to_parameters``, a view of another storage) or after a freed or rebound tensor's memory was
reused equal float64 dense attention: nothing flexc remembers between calls (traces, derived
replays, causal decisions, non-finite verdicts) is served for contents it was not computed from; and
calls with any keyed input changed between them (shapes, strides, dtypes, masks, mods, options, sinks:
what a per-call plan cache keys on) equal it too, in training as well."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import flexc
from reference import dense_attention, index_tensors, random_qkv
from strategies import SWAPS, TRAINING_CHANGES, document_ids, examples, keyed_changes, swap_in

# the swaps that leave the version counter alone: what a memo keyed by identity and version missed
QUIET_SWAPS = SWAPS[:3]
TINY = dict(B=1, Hq=2, Hkv=2, L=32, S=32, E=16)  # (the Triton interpreter runs these)


def _close(got, want, what, atol=2e-5):
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("backend,n", [("TORCH", 5), ("TRITON", 2)])
def test_a_mod_transforming_a_captured_parameter_follows_its_new_contents(backend, n):
    """``score * exp(log_temp)[h]`` without gradients: the replay of ``exp(log_temp)`` is redone
    after every change of ``log_temp``, however made."""
    @examples(n)
    @given(hows=st.lists(st.sampled_from(SWAPS), min_size=1, max_size=2), last=st.sampled_from(QUIET_SWAPS),
           seed=st.integers(0, 1 << 16))
    def check(hows, last, seed):
        g = torch.Generator().manual_seed(seed)
        q, k, v = random_qkv(**TINY, seed=seed)
        log_temp = torch.nn.Parameter(torch.zeros(2))

        def temperature(score, b, h, q_idx, kv_idx):
            return score * torch.exp(log_temp)[h]
        with torch.no_grad():
            for how in (None, *hows, last):
                if how is not None:
                    swap_in(log_temp, torch.randn(2, generator=g), how)
                out = flexc.flex_attention(q, k, v, score_mod=temperature, kernel_options={"BACKEND": backend})
                _close(out, dense_attention(q, k, v, score_mod=temperature)[0], f"after {how}")
    check()


def _lower_triangle(L: int, block: int, mask_mod) -> flexc.BlockMask:
    """A BlockMask listing every block on and below the diagonal as partial: valid for any mask_mod
    that allows no key after its query, so one mask serves every documents' layout."""
    n = L // block
    num = torch.arange(1, n + 1, dtype=torch.int32).view(1, 1, n)
    indices = torch.arange(n, dtype=torch.int32).expand(n, n).contiguous().view(1, 1, n, n)
    return flexc.BlockMask.from_kv_blocks(num, indices, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(L, L))


@pytest.mark.parametrize("backend,n", [("TORCH", 5), ("TRITON", 1)])
def test_a_document_mask_follows_its_ids_new_contents(backend, n):
    """Causal attention inside documents whose captured ids get other contents between calls: the
    documents TORCH runs as causal kernel calls are those of the ids now."""
    L = 128

    @examples(n)
    @given(first=document_ids(L), later=st.lists(st.tuples(document_ids(L), st.sampled_from(QUIET_SWAPS)),
                                                 min_size=1, max_size=2), seed=st.integers(0, 1 << 16))
    def check(first, later, seed):
        q, k, v = random_qkv(1, 2, 2, L, L, 16, seed=seed)
        ids = first.clone()

        def same_document_causal(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
        block_mask = _lower_triangle(L, 32, same_document_causal)
        for new, how in ((None, None), *later):
            if new is not None:
                swap_in(ids, new, how)
            out = flexc.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": backend})
            _close(out, dense_attention(q, k, v, mask_mod=same_document_causal)[0], f"documents {ids.tolist()}")
    check()


def _dense_with_nan_values(q, k, v, mask_mod):
    """Dense attention where a NaN value row poisons exactly the rows that may see its key."""
    clean = torch.where(v.isnan(), 0.0, v)
    out = dense_attention(q, k, clean, mask_mod=mask_mod)[0]
    seen = v.isnan().any(-1)  # [B, H, S]
    b, h, qi, kv = index_tensors(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    poisoned = (torch.broadcast_to(mask_mod(b, h, qi, kv), (*q.shape[:3], k.shape[2])) & seen[:, :, None, :]).any(-1)
    return out.masked_fill(poisoned[..., None], math.nan)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("backend,n", [("TORCH", 5), ("TRITON", 2)])
def test_a_nan_swapped_into_the_values_reaches_only_the_rows_that_see_it(backend, n):
    """``v.data = <v with a NaN>``: the verdict that ``v`` is finite is not served again, so rows
    before the NaN's key stay finite and equal dense attention (and after the NaN is swapped out
    again, every row is)."""
    L = TINY["L"]
    block_mask = flexc.create_block_mask(_causal, None, None, L, L, BLOCK_SIZE=16)

    @examples(n)
    @given(row=st.integers(1, L - 1), how=st.sampled_from(QUIET_SWAPS), back=st.sampled_from(SWAPS),
           seed=st.integers(0, 1 << 16))
    def check(row, how, back, seed):
        q, k, v = random_qkv(**TINY, seed=seed)
        clean = v.clone()
        for new, way in ((None, None), (clean.index_fill(2, torch.tensor([row]), math.nan), how), (clean, back)):
            if new is not None:
                swap_in(v, new, way)
            out = flexc.flex_attention(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": backend})
            _close(out, _dense_with_nan_values(q, k, v, _causal), f"NaN at key {row} ({way})")
    check()


def test_under_compile_a_nan_swapped_into_the_values_reaches_only_the_rows_that_see_it():
    """The same through torch.compile (the custom op's TORCH implementation asks the same memo)."""
    L = TINY["L"]
    block_mask = flexc.create_block_mask(_causal, None, None, L, L, BLOCK_SIZE=16)
    q, k, v = random_qkv(**TINY, seed=3)
    clean = v.clone()
    compiled = torch.compile(flexc.flex_attention, backend="aot_eager", fullgraph=True)
    for new in (None, clean.index_fill(2, torch.tensor([20]), math.nan)):
        if new is not None:
            swap_in(v, new, ".data = new")
        out = compiled(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "TORCH"})
        _close(out, _dense_with_nan_values(q, k, v, _causal), "compiled")


def _document_mask_of(ids):
    def same_document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    return same_document


def _bias_mod_of(bias):
    def with_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    return with_bias


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_a_new_tensor_at_a_reused_address_gets_its_own_trace(backend):
    """Captured tensors keyed by memory (no grad): a new view at the address of an old one that was
    swapped away, or a new tensor where a freed one lay, is traced for its own values, so
    create_mask, create_block_mask and attention read what it holds."""
    L = TINY["L"]
    g = torch.Generator().manual_seed(0)
    q, k, v = random_qkv(**TINY, seed=0)
    ids_base, bias_base = torch.zeros(2, L, dtype=torch.long), torch.zeros(2, L)
    for step in range(6):
        if step < 4:  # new views of a storage that stays: the old view was swapped away
            ids, bias = ids_base[step % 2], bias_base[step % 2]
        else:  # new tensors, likely where the freed ones lay
            ids, bias = torch.randint(0, 3, (L,), generator=g), torch.randn(L, generator=g)
        want = ids[:, None] == ids[None, :]
        assert torch.equal(flexc.create_mask(_document_mask_of(ids), None, None, L, L)[0, 0], want), step
        expect = flexc.create_block_mask(_document_mask_of(ids.clone()), None, None, L, L, BLOCK_SIZE=8)
        got = flexc.create_block_mask(_document_mask_of(ids), None, None, L, L, BLOCK_SIZE=8)
        assert torch.equal(got.kv_num_blocks, expect.kv_num_blocks), step
        with_bias = _bias_mod_of(bias)
        out = flexc.flex_attention(q, k, v, score_mod=with_bias, kernel_options={"BACKEND": backend})
        _close(out, dense_attention(q, k, v, score_mod=with_bias)[0], f"step {step}")
        swap_in(ids, torch.randint(0, 3, (L,), generator=g), ".data = new")
        swap_in(bias, torch.randn(L, generator=g), ".data = new")
        del ids, bias
        ids_base.copy_(torch.randint(0, 3, (2, L), generator=g))
        bias_base.copy_(torch.randn(2, L, generator=g))


# ---- every keyed input changed between calls ---------------------------------------------------
# A per-call plan cache reuses a call's decisions while its key holds: the inputs' shapes, strides,
# dtypes, the BlockMask's identity, tables and attributes, the mods and what they capture, the options
# and the sinks. Each change below moves exactly one of them; every call equals float64 dense attention.

_TEMPERATURE = 1.0  # a global the score_mod reads (rebound by "global read by the mod")
BLOCK = 32
LENGTHS = (32, 48, 64, 128)


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _window_of(width: int):
    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < width
    return window


def _bias_closure(bias):
    """A score_mod adding ``bias[kv_idx]`` times the global temperature, and a function rebinding ``bias``."""
    def with_bias(score, b, h, q_idx, kv_idx):
        return score * _TEMPERATURE + bias[kv_idx]

    def rebind(new):
        nonlocal bias
        bias = new
    return with_bias, rebind


class _Call:
    """The inputs of one flex_attention call, changed one keyed input at a time."""

    def __init__(self, backend: str, training: bool, seed: int, attention=flexc.flex_attention):
        self.backend, self.training, self.attention = backend, training, attention
        self.g = torch.Generator().manual_seed(seed)
        self.B, self.Hq, self.Hkv, self.L, self.S, self.D, self.dtype = 1, 2, 2, 64, 64, 16, torch.float32
        self.layout, self.gqa = "contiguous", False
        self.ids = torch.randint(0, 3, (128,), generator=self.g).sort().values  # a document mask's captured ids
        self.bias = self._captured(torch.randn(128, generator=self.g))
        self.score_mod, self.rebind = _bias_closure(self.bias)
        self.mask_kind, self.scale, self.extra, self.outputs, self.sinks = "causal", None, {}, "out", None
        self.qkv = [None, None, None]
        self.new_qkv()
        self.new_mask()

    def _captured(self, t):
        return t.requires_grad_() if self.training else t

    def rand(self, *shape):
        return torch.randn(shape, generator=self.g, dtype=torch.float64)

    def laid_out(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` in the current dtype and layout (a permuted storage, or rows padded past D)."""
        values = values.to(self.dtype)
        if self.layout == "permuted":  # [B, L, H, D] storage
            t = values.transpose(1, 2).contiguous().transpose(1, 2)
        elif self.layout == "padded rows":
            t = torch.zeros(*values.shape[:-1], values.shape[-1] + 8, dtype=self.dtype)[..., :values.shape[-1]]
            t.copy_(values)
        else:
            t = values.contiguous()
        return t.requires_grad_() if self.training else t

    def new_qkv(self, which=(0, 1, 2)):
        shapes = [(self.B, self.Hq, self.L, self.D), (self.B, self.Hkv, self.S, self.D), (self.B, self.Hkv, self.S, self.D)]
        for i in which:
            self.qkv[i] = self.laid_out(self.rand(*shapes[i]))

    def mask_mod(self):
        return {"causal": _causal_mod, "window": _window_of(int(self.width)),
                "document": _document_mask_of(self.ids)}[self.mask_kind]

    def new_mask(self):
        if self.mask_kind is None:
            self.block_mask = None
            return
        self.width = torch.randint(8, 70, (), generator=self.g)
        self.block_mask = flexc.create_block_mask(self.mask_mod(), None, None, self.L, self.S, BLOCK_SIZE=BLOCK)

    def change(self, what: str, seed: int) -> None:
        rng = torch.Generator().manual_seed(seed)
        pick = lambda n: int(torch.randint(0, n, (), generator=rng))  # noqa: E731
        global _TEMPERATURE
        if what == "q k or v values":
            i = pick(3)
            how = SWAPS[pick(len(SWAPS))] if not self.training else SWAPS[pick(3)]
            if self.layout != "contiguous" and how != "in-place write":
                how = ".data = new"  # (a swap brings its own layout: keep the drawn one for the next change)
            swap_in(self.qkv[i], self.laid_out(self.rand(*self.qkv[i].shape)).detach(), how)
        elif what == "q k or v at a reused address":
            i = pick(3)
            shape = self.qkv[i].shape
            self.qkv[i] = None
            self.qkv[i] = self.laid_out(self.rand(*shape))
        elif what in ("lengths", "head dim", "batch and heads", "gqa"):
            if what == "lengths":
                self.L, self.S = LENGTHS[pick(4)], LENGTHS[pick(4)]
            elif what == "head dim":
                self.D = (16, 32)[pick(2)]
            elif what == "batch and heads":
                self.B, heads = 1 + pick(2), 1 + pick(2)
                self.Hkv, self.Hq = heads, heads * (self.Hq // self.Hkv)
            else:
                self.gqa = not self.gqa
                self.Hq = self.Hkv * (2 if self.gqa else 1)
            self.new_qkv()
            if self.sinks is not None:
                self.sinks = self._captured(self.rand(self.Hq).float())
            if what == "lengths":
                self.new_mask()
        elif what == "layout":
            self.layout = ("contiguous", "permuted", "padded rows")[pick(3)]
            self.qkv = [self.laid_out(t.detach()) for t in self.qkv]
        elif what == "dtype":
            self.dtype = (torch.float32, torch.float64, torch.bfloat16)[pick(3)]
            self.qkv = [self.laid_out(t.detach()) for t in self.qkv]
        elif what == "another mask":
            self.mask_kind = ("causal", "window", "document")[pick(3)]
            self.new_mask()
        elif what == "no mask":
            self.mask_kind = None
            self.new_mask()
        elif what in ("mask table in place", "mask table .data"):
            if self.block_mask is None:
                self.mask_kind = "causal"
                self.new_mask()
            full = self.block_mask.full_kv_num_blocks is not None and pick(2)
            table = self.block_mask.full_kv_num_blocks if full else self.block_mask.kv_num_blocks
            edited = table.clone()
            row = pick(edited.shape[-1])
            edited[..., row] = (edited[..., row] - 1).clamp(min=0)  # the row's last listed block dropped
            swap_in(table, edited, "in-place write" if what == "mask table in place" else ".data = new")
        elif what == "mask.mask_mod =":
            if self.block_mask is None:
                self.mask_kind = "causal"
                self.new_mask()
            self.block_mask.mask_mod = (_window_of(int(torch.randint(4, 40, (), generator=rng))),
                                        _document_mask_of(self.ids.roll(pick(50))), _causal_mod)[pick(3)]
        elif what == "mask.seq_lengths =":
            if self.block_mask is None:
                self.mask_kind = "causal"
                self.new_mask()
            # the tables of a longer mask serve shorter queries once seq_lengths says so; lengths the
            # inputs do not have raise
            L, S = self.block_mask.seq_lengths
            shorter = [n for n in LENGTHS if n < L]
            if shorter and pick(2):
                self.L = shorter[pick(len(shorter))]
                self.block_mask.seq_lengths = (self.L, S)
                self.new_qkv((0,))
            else:
                self.block_mask.seq_lengths = (L + BLOCK, S)
                # (under torch.compile(fullgraph=True) dynamo reports the ValueError as its own error)
                with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match="seq_lengths"):
                    self.call()
                self.block_mask.seq_lengths = (L, S)
        elif what == "new score_mod closure":
            self.bias = self._captured(self.rand(128).float())
            self.score_mod, self.rebind = _bias_closure(self.bias)
        elif what == "captured tensor rebound":
            self.bias = self._captured(self.rand(128).float())
            self.rebind(self.bias)
        elif what == "captured tensor values":
            how = SWAPS[pick(len(SWAPS))] if not self.training else SWAPS[pick(3)]
            swap_in(self.bias, self.rand(128).float(), how)
        elif what == "global read by the mod":
            _TEMPERATURE = float(torch.rand((), generator=rng)) + 0.5
        elif what == "no score_mod":
            self.score_mod = None if self.score_mod is not None else _bias_closure(self.bias)[0]
        elif what == "scale":
            self.scale = (None, 0.3, 1.0)[pick(3)]
        elif what == "kernel_options":
            self.extra = ({}, {"BLOCK_M": 32, "BLOCK_N": 32}, {"num_warps": 2, "num_stages": 1}, {"FAST_MATH": False})[pick(4)]
        elif what == "outputs":
            self.outputs = ("out", "lse", "aux")[pick(3)]
        elif what == "sinks values":
            if self.sinks is None:
                self.sinks = self._captured(self.rand(self.Hq).float())
            else:
                swap_in(self.sinks, self.rand(*self.sinks.shape).float(), SWAPS[pick(len(SWAPS))])
        elif what == "sinks shape":
            shape = ((self.Hq,), (self.B, 1), (self.B, self.Hq), ())[pick(4)]
            self.sinks = None if self.sinks is not None and pick(3) == 0 else self._captured(self.rand(*shape).float())
        else:
            raise AssertionError(f"no such change: {what}")

    def call(self):
        q, k, v = self.qkv
        return self.attention(q, k, v, score_mod=self.score_mod, block_mask=self.block_mask, scale=self.scale,
                              enable_gqa=self.gqa, return_lse=self.outputs == "lse",
                              kernel_options={"BACKEND": self.backend, **self.extra}, sinks=self.sinks,
                              return_aux=self.aux if self.outputs == "aux" else None)

    @property
    def aux(self):
        """lse, and max_scores where the backend gives them (TORCH only: others raise, saying so)."""
        return flexc.AuxRequest(lse=True, max_scores=self.backend == "TORCH")

    def reference_mask(self):
        """The allowed ``[B or 1, H or 1, L, S]`` of the block mask as it is now: its full tiles, and
        its partial tiles where its mask_mod allows."""
        bm = self.block_mask
        if bm is None:
            return None
        qb, kb = bm.BLOCK_SIZE

        def listed(num, idx):
            tiles = torch.zeros(*idx.shape, dtype=torch.int32)
            tiles.scatter_add_(-1, idx.long(), (torch.arange(idx.shape[-1]) < num[..., None]).to(torch.int32))
            return (tiles > 0).repeat_interleave(qb, -2).repeat_interleave(kb, -1)[..., :self.L, :self.S]
        partial = listed(bm.kv_num_blocks, bm.kv_indices)
        full = listed(bm.full_kv_num_blocks, bm.full_kv_indices) if bm.full_kv_num_blocks is not None else False
        b, h, qi, kv = index_tensors(self.B, self.Hq, self.L, self.S)
        return full | (partial & torch.broadcast_to(bm.mask_mod(b, h, qi, kv), (self.B, self.Hq, self.L, self.S)))

    def check(self, what):
        q, k, v = self.qkv
        got = self.call()
        out, lse = (got, None) if self.outputs == "out" else (got[0], got[1] if self.outputs == "lse" else got[1].lse)
        allowed = self.reference_mask()
        want, want_lse, want_max = dense_attention(q, k, v, score_mod=self.score_mod, scale=self.scale, sinks=self.sinks,
                                                   mask_mod=None if allowed is None else lambda *_: allowed)
        atol = {torch.float64: 1e-9, torch.float32: 5e-5, torch.bfloat16: 3e-2}[self.dtype]
        _close(out, want.detach(), f"after {what}", atol)
        if lse is not None:
            _close(lse, want_lse.detach(), f"lse after {what}", atol)
        if self.outputs == "aux" and self.aux.max_scores and self.sinks is None:  # (fp32 whatever the inputs)
            _close(got[1].max_scores, want_max.detach(), f"max_scores after {what}", max(atol, 5e-5))
        if self.training:
            grad_out = self.rand(*out.shape).to(out.dtype)
            leaves = [*self.qkv, self.bias, *([self.sinks] if self.sinks is not None else [])]
            used = [t for t in leaves if t is not None]
            got = torch.autograd.grad((out * grad_out).sum(), used, allow_unused=True)
            wanted = torch.autograd.grad((want * grad_out.double()).sum(), used, allow_unused=True)
            for i, (a, b) in enumerate(zip(got, wanted)):
                if b is None:
                    assert a is None or not a.any(), f"gradient {i} after {what}"
                else:
                    _close(a, b.double(), f"gradient {i} after {what}", 2e-4)


def _run_changes(backend, training, changes, seed, attention=flexc.flex_attention):
    call = _Call(backend, training, seed, attention)
    call.check("the first call")
    for what, change_seed in changes:
        call.change(what, change_seed)
        call.check(what)


def _run_changes_on(backend: str, training: bool, changes, seed) -> None:
    """:func:`_run_changes` on ``backend``; ``"sm_90"``: AUTO on CPU tensors standing in for that GPU."""
    if backend.startswith("sm_"):
        with flexc.device.simulate(backend):
            _run_changes("AUTO", training, changes, seed)
    else:
        _run_changes(backend, training, changes, seed)


@pytest.mark.parametrize("backend,n,steps", [("TORCH", 25, 8), ("TRITON", 4, 4), ("sm_90", 4, 4)])
def test_every_keyed_input_changed_between_calls_equals_dense(backend, n, steps):
    """Calls with one keyed input changed between them (:data:`strategies.KEYED_CHANGES`): values in
    place and swapped in, reused addresses, shapes, strides, dtypes, masks and their tables and
    attributes, mods and their captures and globals, options and sinks; on TORCH, TRITON (Triton's
    interpreter) and the simulated sm_90 (AUTO's CUDA decisions)."""
    @examples(n)
    @given(changes=keyed_changes(max_size=steps), seed=st.integers(0, 1 << 16))
    def check(changes, seed):
        _run_changes_on(backend, False, changes, seed)
    check()


@pytest.mark.parametrize("backend,n,steps", [("TORCH", 6, 4), ("sm_90", 2, 2)])
def test_every_keyed_input_changed_between_training_steps_gives_dense_gradients(backend, n, steps):
    """The same changes between training steps (:data:`strategies.TRAINING_CHANGES`): q, k, v, the
    captured bias and the sinks get the gradients of float64 autograd."""
    @examples(n)
    @given(changes=keyed_changes(TRAINING_CHANGES, max_size=steps), seed=st.integers(0, 1 << 16))
    def check(changes, seed):
        _run_changes_on(backend, True, changes, seed)
    check()


def test_every_keyed_input_changed_between_compiled_calls_equals_dense():
    """The same changes between calls of ``torch.compile(flex_attention, fullgraph=True)`` on TORCH:
    dynamo's guards and flexc's custom op see each one (a recompile, or the op reading it)."""
    @examples(4)
    @given(changes=keyed_changes(max_size=3), seed=st.integers(0, 1 << 16))
    def check(changes, seed):
        torch._dynamo.reset()  # (each example's recompiles from scratch: fullgraph=True fails at dynamo's limit)
        _run_changes("TORCH", False, changes, seed, torch.compile(flexc.flex_attention, backend="aot_eager",
                                                                    fullgraph=True))
    check()
    torch._dynamo.reset()
