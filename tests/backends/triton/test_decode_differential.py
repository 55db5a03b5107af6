"""A differential fuzzer of the decode paths (at most 16 query rows): flexc against the float64
dense reference (tests/reference.py) and torch's own eager FlexAttention.

Hypothesis draws decoding calls the way KV-cache users make them: catalogue masks and score_mods
(tests/catalogue.py) for query rows sitting at an offset into the cache (a Python int or a 0-d
tensor, int32 or int64, the gpt-fast idiom), ragged per-batch cache lengths, GQA, batch > 1 and a
key/value batch of 1, several block sizes, BlockMasks built directly, sliced from a whole-sequence
mask (``bm[:, :, pos // BLOCK]`` with ``mask_mod``/``seq_lengths`` reattached) or built by torch,
non-contiguous layouts, NaN in cache positions that the mask hides, and fully masked rows.

Each case asserts which path ran (the CPU decode path, or the Triton split-KV decode kernel under
Triton's interpreter on tiny sizes) and checks output and logsumexp: fully masked rows are exactly
0 / -inf in all three. ``FLEXC_FUZZ_EXAMPLES`` scales the number of examples (default 1).
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.nn.attention import flex_attention as torch_flex

import flexc
from flexc.backends.cpu import decode_cpu
from flexc.backends.triton import decode as triton_decode, forward as triton_forward
from catalogue import mask_catalogue, score_catalogue
from reference import dense_attention

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

_SCALE = float(os.environ.get("FLEXC_FUZZ_EXAMPLES", "1"))


def fuzz(n: int) -> settings:
    """``n`` examples (times FLEXC_FUZZ_EXAMPLES), the same ones every run unless FLEXC_FUZZ_RANDOM is set."""
    return settings(max_examples=max(1, int(n * _SCALE)), deadline=None, print_blob=True,
                    derandomize=not os.environ.get("FLEXC_FUZZ_RANDOM"), database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.lru_cache(maxsize=64)
def catalogues(B: int, H: int, N: int):
    """Catalogue mods for a sequence of ``N`` positions (query rows at an offset stay in range)."""
    return mask_catalogue(B, H, N, N), score_catalogue(B, H, N, N)


# masks that ignore kv_idx (query padding, rows or batches switched off): one verdict per row
KV_BLIND_MASKS = {
    "query_rows_parity": lambda b, h, q_idx, kv_idx: q_idx % 3 != 1,
    "batch_switched_off": lambda b, h, q_idx, kv_idx: (b != 1) & (q_idx >= 0),
}
MASK_NAMES = sorted(mask_catalogue(1, 1, 8, 8)) + sorted(KV_BLIND_MASKS)
SCORE_NAMES = sorted(score_catalogue(1, 1, 8, 8))


def at_offset(mod, offset, score=False):
    """``mod`` seen from query rows at ``offset`` of the sequence (q_idx 0 is position ``offset``)."""
    if mod is None:
        return None
    if score:
        return lambda s, b, h, q_idx, kv_idx: mod(s, b, h, q_idx + offset, kv_idx)
    return lambda b, h, q_idx, kv_idx: mod(b, h, q_idx + offset, kv_idx)


def with_cache_lengths(mod, lengths):
    """``mod`` restricted to each batch's filled cache prefix (ragged cache lengths)."""
    if mod is None:
        return lambda b, h, q_idx, kv_idx: kv_idx < lengths[b]
    return lambda b, h, q_idx, kv_idx: (kv_idx < lengths[b]) & mod(b, h, q_idx, kv_idx)


# ---- drawing a decoding call ------------------------------------------------------------------

@st.composite
def decode_cases(draw, triton: bool = False):
    if triton:  # the interpreter pays per tile: tiny problems
        B = draw(st.integers(1, 2))
        Hkv = draw(st.integers(1, 2))
        G = draw(st.sampled_from([1, 2, 3, 4]))
        L = draw(st.sampled_from([1, 1, 2, 3, 6]))  # G * L up to 24: packed tiles of 16 and 32 rows
        S = draw(st.integers(1, 100))
        E = draw(st.sampled_from([16, 16, 12]))  # 12: a padded head dim
        Ev = draw(st.sampled_from([E, 8]))
        dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float64, torch.float16,
                                      torch.bfloat16]))
        # 48: each key block spans three 16-key tiles
        block = draw(st.sampled_from([16, 32, (16, 32), (32, 16), (16, 48), (1, 32)]))
    else:
        B = draw(st.integers(1, 3))
        Hkv = draw(st.integers(1, 3))
        G = draw(st.sampled_from([1, 1, 2, 4]))
        L = draw(st.integers(1, 16))
        S = draw(st.integers(1, 300))
        E = draw(st.sampled_from([8, 16, 12]))
        Ev = draw(st.sampled_from([E, E, 4]))
        dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float64, torch.float16,
                                      torch.bfloat16]))
        block = draw(st.sampled_from([16, 32, 64, 128, (16, 64), (1, 32), (128, 16), (8, 24)]))
    q_block, kv_block = block if isinstance(block, tuple) else (block, block)
    offset = draw(st.integers(0, S + 8))  # position of the first query row (may pass the cache end)
    return dict(
        B=B, Hkv=Hkv, Hq=Hkv * G, L=L, S=S, E=E, Ev=Ev, dtype=dtype, q_block=q_block, kv_block=kv_block,
        Bkv=draw(st.sampled_from([B, 1])),
        offset=offset,
        offset_kind=draw(st.sampled_from(["int", "int64", "int32"])),
        mask=draw(st.sampled_from([None, *MASK_NAMES])),
        score=draw(st.one_of(st.none(), st.sampled_from(SCORE_NAMES))),
        scale=draw(st.sampled_from([None, None, 0.3, -0.5])),
        ragged=draw(st.booleans()),
        lengths_seed=draw(st.integers(0, 2 ** 16)),
        mask_batch=draw(st.sampled_from(["B", "None", "None"])),
        mask_heads=draw(st.sampled_from(["H", "None", "None"])),
        build=draw(st.sampled_from(["direct", "sliced", "sliced_tensor_index", "sliced_torch", "torch",
                                    "no_full_tables",
                                    "reclassified"])),
        layout=draw(st.sampled_from(["contiguous", "bshd", "cache_slice", "expanded_kv", "strided_dim"])),
        nan_masked=draw(st.booleans()),
        max_scores=draw(st.booleans()),
        grad=draw(st.sampled_from([False, False, True])),
        seed=draw(st.integers(0, 2 ** 16)),
        q_gain=draw(st.sampled_from([1.0, 1.0, 12.0])),  # large scores: the online max and the merge matter
        mode=draw(st.sampled_from(["default", "default", "no_grad", "inference_mode"])),
    )


def build_inputs(c):
    """q, k, v in the drawn layout (values drawn in float64 then cast, so the reference sees the same)."""
    g = torch.Generator().manual_seed(c["seed"])
    B, Bkv, Hq, Hkv, L, S, E, Ev, dtype = (c[k] for k in ("B", "Bkv", "Hq", "Hkv", "L", "S", "E", "Ev", "dtype"))

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    layout = c["layout"]
    if layout == "bshd":  # [B, L, H, E] storage, as models keep it, viewed as [B, H, L, E]
        q = randn(B, L, Hq, E).transpose(1, 2)
        k, v = randn(Bkv, S, Hkv, E).transpose(1, 2), randn(Bkv, S, Hkv, Ev).transpose(1, 2)
    elif layout == "cache_slice":  # the filled prefix of a longer preallocated cache (NaN after it)
        q = randn(B, Hq, L, E)
        k_cache, v_cache = randn(Bkv, Hkv, S + 5, E), randn(Bkv, Hkv, S + 5, Ev)
        k_cache[:, :, S:], v_cache[:, :, S:] = float("nan"), float("nan")
        k, v = k_cache[:, :, :S], v_cache[:, :, :S]
    elif layout == "expanded_kv":  # one key/value batch broadcast by stride 0
        q = randn(B, Hq, L, E)
        k, v = randn(1, Hkv, S, E).expand(Bkv, -1, -1, -1), randn(1, Hkv, S, Ev).expand(Bkv, -1, -1, -1)
    elif layout == "strided_dim":  # every other element of the head dim
        q = randn(B, Hq, L, 2 * E)[..., ::2]
        k, v = randn(Bkv, Hkv, S, 2 * E)[..., ::2], randn(Bkv, Hkv, S, 2 * Ev)[..., ::2]
    else:
        q, k, v = randn(B, Hq, L, E), randn(Bkv, Hkv, S, E), randn(Bkv, Hkv, S, Ev)
    if c["q_gain"] != 1.0:
        q = (q.double() * c["q_gain"]).to(dtype)
    return q, k, v


def build_mods(c):
    """``(score_mod, mask_mod)`` at the drawn offset (None where absent)."""
    B, Hq, L, S, offset = c["B"], c["Hq"], c["L"], c["S"], c["offset"]
    N = max(S, offset + L)
    masks, scores = catalogues(B, Hq, N)
    masks = {**masks, **KV_BLIND_MASKS}
    if c["offset_kind"] == "int":
        shift = offset
    else:
        shift = torch.tensor(offset, dtype=torch.int32 if c["offset_kind"] == "int32" else torch.int64)
    mask_mod = at_offset(masks[c["mask"]], shift) if c["mask"] is not None else None
    score_mod = at_offset(scores[c["score"]], shift, score=True) if c["score"] is not None else None
    if c["ragged"]:
        g = torch.Generator().manual_seed(c["lengths_seed"])
        lengths = torch.randint(0, S + 1, (B,), generator=g)
        lengths[0] = S if B > 1 else lengths[0]  # one full cache, the others ragged (0 included)
        mask_mod = with_cache_lengths(mask_mod, lengths)
    return score_mod, mask_mod


def build_block_mask(c, mask_mod, lib=flexc):
    """The BlockMask the drawn way (None without a mask_mod); ``lib`` is flexc or torch's module."""
    if mask_mod is None:
        return None
    L, S, offset = c["L"], c["S"], c["offset"]
    # a broadcast batch or head dim only for masks that do not vary along it (else the tables of
    # batch/head 0 would serve all: a wrong mask, not a wrong kernel)
    varies_b, varies_h = _varies(mask_mod, c["B"], c["Hq"], L, S)
    B = c["B"] if c["mask_batch"] == "B" or varies_b else None
    H = c["Hq"] if c["mask_heads"] == "H" or varies_h else None
    block = (c["q_block"], c["kv_block"])
    kw = {"device": "cpu"} if lib is torch_flex else {}
    # the rows lie in one query block of the whole mask, or start a block (a chunk of several rows)
    sliceable = offset % block[0] + L <= block[0] or offset % block[0] == 0
    if lib is flexc and c["build"].startswith("sliced") and sliceable:
        # gpt-fast: a mask over the whole sequence, sliced to the query block of the current position
        N = max(S, offset + L)
        masks, _ = catalogues(c["B"], c["Hq"], N)
        masks = {**masks, **KV_BLIND_MASKS}
        whole_mod = masks[c["mask"]] if c["mask"] is not None else (lambda b, h, q_idx, kv_idx: q_idx >= 0)
        if c["ragged"]:
            whole_mod = with_cache_lengths(whole_mod if c["mask"] is not None else None, _lengths_of(mask_mod))
        if c["build"] == "sliced_torch":  # torch's mask and torch's slicing, handed to flexc
            whole = torch_flex.create_block_mask(whole_mod, B, H, N, S, device="cpu", BLOCK_SIZE=block)
        else:
            whole = flexc.create_block_mask(whole_mod, B, H, N, S, BLOCK_SIZE=block)
        row, end = offset // block[0], -(-(offset + L) // block[0])
        if end - row > 1:
            sliced = whole[:, :, row:end]
        elif c["build"] == "sliced_tensor_index":
            sliced = whole[:, :, torch.tensor([row])]
        else:
            sliced = whole[:, :, row]
        sliced.mask_mod, sliced.seq_lengths = mask_mod, (L, S)
        return sliced
    if lib is flexc and c["build"] == "torch":  # torch's BlockMask, handed to flexc as is
        return torch_flex.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)
    if lib is flexc and c["build"] == "reclassified":
        return reclassified(flexc.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=block), c["seed"])
    if lib is flexc and c["build"] == "no_full_tables":  # every listed block partial (from_kv_blocks)
        bm = flexc.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=block)
        dense = bm.to_dense()
        counts = dense.sum(-1, dtype=torch.int32)
        indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
        return flexc.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(L, S))
    return lib.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=block, **kw)


def reclassified(bm, seed):
    """The same mask with other tables (from_kv_blocks): some full blocks demoted to partial, some
    empty blocks listed as partial (the mask_mod decides both exactly), entries in random order.
    Rows then mix partial and full blocks in ways create_block_mask never produces."""
    g = torch.Generator().manual_seed(seed)
    classes = bm._tile_classes()  # 0 empty, 1 partial, 2 full
    r = torch.rand(classes.shape, generator=g)
    full = (classes == 2) & (r < 0.5)
    partial = (classes == 1) | ((classes == 2) & ~full) | ((classes == 0) & (r < 0.3))

    def ordered(dense):
        perm = torch.randperm(dense.shape[-1], generator=g)
        order = torch.argsort(dense[..., perm].to(torch.int8), dim=-1, descending=True, stable=True)
        return dense.sum(-1, dtype=torch.int32), perm[order].to(torch.int32)

    return flexc.BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=bm.BLOCK_SIZE,
                                          mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths)


def _varies(mask_mod, B, H, L, S):
    """Whether the dense mask differs between batches, between heads."""
    b, h, qi, kv = (torch.arange(n).view(*[n if i == d else 1 for i in range(4)]) for d, n in enumerate((B, H, L, S)))
    allowed = torch.broadcast_to(mask_mod(b, h, qi, kv), (B, H, L, S))
    return bool((allowed != allowed[:1]).any()), bool((allowed != allowed[:, :1]).any())


def _lengths_of(mask_mod):
    """The captured cache lengths of a :func:`with_cache_lengths` mod."""
    return next(cell.cell_contents for cell in mask_mod.__closure__ if isinstance(cell.cell_contents, torch.Tensor))


def hide_nan_in_masked_cache(q, k, v, mask_mod):
    """Copies of k and v with NaN at every cache position that no query row of its (batch, key head)
    may attend: an uninitialised or stale cache, which must not reach the output."""
    B, Hq, L, _ = q.shape
    Bkv, Hkv, S, _ = k.shape
    b, h, qi, kv = (torch.arange(n).view(*[n if i == d else 1 for i in range(4)]) for d, n in enumerate((B, Hq, L, S)))
    allowed = torch.broadcast_to(mask_mod(b, h, qi, kv), (B, Hq, L, S))
    # [B, Hkv, S]: some row of the group attends; a key batch of 1 serves every query batch
    used = allowed.view(B, Hkv, Hq // Hkv, L, S).any(2).any(2)
    used = used.any(0, keepdim=True) if Bkv == 1 else used
    hidden = ~used.view(Bkv, Hkv, S, 1)
    if not hidden.any():
        return None
    k2 = k.detach().clone().masked_fill_(hidden, float("nan"))
    v2 = v.detach().clone().masked_fill_(hidden, float("nan"))
    return k2, v2


MODES = {"default": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def kernel_tolerance(dtype, backend):
    """A kernel evaluates the float32 parts of a mod (an int index times a Python float, then
    sigmoid/exp) with its own float32 functions, a few ulps from torch's: ~1e-7 in float64 calls."""
    return 1e-6 if backend == "TRITON" and dtype == torch.float64 else tolerances(dtype)


def tolerances(dtype):
    return {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}[dtype]


def assert_matches(out, lse, ref_out, ref_lse, dtype, what, atol=None):
    atol = atol or tolerances(dtype)
    assert out.shape == ref_out.shape and out.dtype == dtype, what
    assert not out.isnan().any(), f"{what}: NaN in the output"
    torch.testing.assert_close(out.double(), ref_out.double(), atol=atol, rtol=atol, msg=lambda m: f"{what}: {m}")
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead), f"{what}: fully masked rows differ (lse -inf)"
    assert torch.all(out[dead] == 0), f"{what}: a fully masked row has a nonzero output"
    torch.testing.assert_close(lse[~dead].double(), ref_lse[~dead].double(), atol=max(atol, 1e-5), rtol=max(atol, 1e-5),
                               msg=lambda m: f"{what} (lse): {m}")


def run_case(c, backend):
    q, k, v = build_inputs(c)
    score_mod, mask_mod = build_mods(c)
    bm = build_block_mask(c, mask_mod)
    gqa = c["Hq"] != c["Hkv"]
    options = {"BACKEND": backend}
    scale = c["scale"]
    ref_out, ref_lse, ref_max = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, scale=scale)
    if c["dtype"] == torch.float16 or c["dtype"] == torch.bfloat16:
        ref_out = ref_out.to(c["dtype"])  # what the rounding of the output allows
    spy_target = (decode_cpu, "forward") if backend == "TORCH" else (triton_decode.DecodeLaunch, "__call__")
    if backend == "TRITON" and not triton_decode.applies(q, k, bm):
        # per-head masks under GQA, or rows past the first query block: the forward kernel serves
        # these short queries, and needs query blocks of 16 or more
        spy_target = (triton_forward.ForwardLaunch, "__call__")
        if bm is not None and c["q_block"] % 16:
            with pytest.raises(ValueError, match="multiple of 16"):
                flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa,
                                     kernel_options=options)
            return None
    with mock.patch.object(*spy_target, autospec=True, side_effect=getattr(*spy_target)) as spy:
        out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa,
                                        return_lse=True, kernel_options=options)
    assert spy.call_count == 1, f"the {backend} path for short queries did not run"
    atol = kernel_tolerance(c["dtype"], backend)
    assert_matches(out, lse, ref_out, ref_lse, c["dtype"], f"{backend} vs dense", atol=atol)
    if backend == "TORCH" and c["max_scores"]:  # the row maxima of the masked, modded scores
        out3, aux = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa,
                                         return_aux=flexc.AuxRequest(lse=True, max_scores=True))
        assert_matches(out3, aux.lse, ref_out, ref_lse, c["dtype"], "TORCH with return_aux")
        dead = torch.isneginf(ref_max)
        assert torch.equal(torch.isneginf(aux.max_scores), dead), "max_scores of fully masked rows"
        torch.testing.assert_close(aux.max_scores[~dead].double(), ref_max[~dead], atol=1e-4, rtol=1e-4)
    if backend == "TORCH" and c["grad"] and c["mode"] == "default" and c["dtype"] in (torch.float32, torch.float64):
        check_gradients(c, q, k, v, score_mod, mask_mod, bm)
    # masked cache positions holding NaN (keys and values) change nothing
    if c["nan_masked"] and mask_mod is not None:
        poisoned = hide_nan_in_masked_cache(q, k, v, mask_mod)
        if poisoned is not None:
            k2, v2 = poisoned
            out2, lse2 = flexc.flex_attention(q, k2, v2, score_mod=score_mod, block_mask=bm, scale=scale,
                                              enable_gqa=gqa, return_lse=True, kernel_options=options)
            assert_matches(out2, lse2, ref_out, ref_lse, c["dtype"], f"{backend} with NaN in the masked cache",
                           atol=atol)
    return q, k, v, score_mod, mask_mod, out, lse


def check_gradients(c, q, k, v, score_mod, mask_mod, bm):
    """The backward of a decode-path forward (it keeps that forward's logsumexp) against autograd
    through the dense reference: gradients of q, k, v for a random output cotangent."""
    gqa = c["Hq"] != c["Hkv"]
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(c["seed"] + 1),
                           dtype=torch.float64).to(q.dtype)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = flexc.flex_attention(qs, ks, vs, score_mod=score_mod, block_mask=bm, scale=c["scale"], enable_gqa=gqa)
    grads = torch.autograd.grad(out, (qs, ks, vs), grad_out, allow_unused=True, materialize_grads=True)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_attention(qr, kr, vr, score_mod=score_mod, mask_mod=mask_mod, scale=c["scale"])[0]
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), grad_out.double(), allow_unused=True, materialize_grads=True)
    atol = 1e-8 if c["dtype"] == torch.float64 else 2e-3
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=atol, rtol=atol, msg=lambda m: f"d{name}: {m}")


def check_against_torch(c, q, k, v, score_mod, mask_mod, out, lse):
    """torch's eager FlexAttention on its own BlockMask (finite inputs) agrees with flexc."""
    if c["dtype"] in (torch.float16, torch.bfloat16):
        return  # torch's eager path computes 16-bit scores in 16 bits: it is the less accurate side
    if c["Bkv"] != c["B"]:  # torch broadcasts a key/value batch of 1 only under a BlockMask with every batch
        c = {**c, "mask_batch": "B"}
        mask_mod = mask_mod if mask_mod is not None else (lambda b, h, q_idx, kv_idx: kv_idx >= 0)
    tbm = build_block_mask(c, mask_mod, lib=torch_flex)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_out, t_lse = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=tbm, scale=c["scale"],
                                                 enable_gqa=c["Hq"] != c["Hkv"], return_lse=True)
    # torch's eager path runs float32 parts of a mod (an int index times a Python float) its own
    # way: ~1e-8 from the float64 reference, where flexc is exact
    assert_matches(out, lse, t_out, t_lse.to(lse.dtype), c["dtype"], "flexc vs torch",
                   atol=max(1e-6, tolerances(c["dtype"])))


@fuzz(80)
@given(decode_cases())
def test_cpu_decode_path_matches_dense_and_torch(case):
    with MODES[case["mode"]]():  # inputs and masks made and used under the mode, as a decoding loop does
        result = run_case(case, "TORCH")
        check_against_torch(case, *result)


@fuzz(16)
@given(decode_cases(triton=True))
def test_triton_decode_kernel_matches_dense(case):
    with MODES[case["mode"]]():
        run_case(case, "TRITON")


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("shape", [(1, 0, 3), (0, 2, 3), (2, 2, 1)])
def test_empty_heads_batch_or_cache_on_the_decode_paths(backend, shape):
    """No query heads, no batch or no cached key: an empty output, or zero rows with lse -inf (the
    decode paths once divided by the number of key heads)."""
    B, H, L = shape
    S = 0 if H and B else 10
    q = torch.randn(B, H, L, 16, requires_grad=True)
    k, v = torch.randn(B, H, S, 16), torch.randn(B, H, S, 16)
    out, lse = flexc.flex_attention(q, k, v, return_lse=True, kernel_options={"BACKEND": backend})
    assert out.shape == (B, H, L, 16) and lse.shape == (B, H, L)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    out.sum().backward()
    assert q.grad.shape == q.shape and torch.all(q.grad == 0)


@pytest.mark.parametrize("kv_block", [48, 80])
def test_triton_decode_key_blocks_that_are_not_powers_of_two(kv_block):
    """A key block of 48 or 80 runs as 16-key tiles (the interpreter once took the whole block as one
    tile and failed: tl.arange needs a power of two)."""
    g = torch.Generator().manual_seed(kv_block)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((2, 4, 3, 16), (2, 2, 200, 16), (2, 2, 200, 16)))
    mask_mod = at_offset(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 130), 150)
    bm = flexc.create_block_mask(mask_mod, None, None, 3, 200, BLOCK_SIZE=(16, kv_block))
    assert triton_decode.applies(q, k, bm)
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True,
                                    kernel_options={"BACKEND": "TRITON"})
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=mask_mod)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32, f"TRITON, key blocks of {kv_block}")


@pytest.mark.parametrize("L", [16, 17])
def test_float64_logsumexp_just_below_and_above_the_decode_rows(L):
    """A float64 call's logsumexp is float64-exact on the TRITON backend whichever kernel runs (the
    forward kernel once wrote it in fp32 for calls without gradients: errors of 2e-7)."""
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((1, 2, L, 16), (1, 2, 64, 16),
                                                                                    (1, 2, 64, 16)))
    out, lse = flexc.flex_attention(q, k, v, scale=0.3, return_lse=True, kernel_options={"BACKEND": "TRITON"})
    ref_out, ref_lse, _ = dense_attention(q, k, v, scale=0.3)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)


# ---- paged KV caches (torch's PagedAttention) -------------------------------------------------

@st.composite
def paged_cases(draw, triton: bool = False):
    B = draw(st.integers(1, 3))
    L = draw(st.integers(1, 3))
    return dict(
        B=B, Hkv=draw(st.integers(1, 2)), G=draw(st.sampled_from([1, 2, 4])), L=L,
        page=draw(st.sampled_from([16, 32])),
        lengths=draw(st.lists(st.integers(L, 100 if triton else 150), min_size=B, max_size=B)),
        spare_pages=draw(st.integers(0, 2)),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        mask=draw(st.sampled_from([None, *MASK_NAMES])),
        score=draw(st.one_of(st.none(), st.sampled_from(SCORE_NAMES))),
        order_seed=draw(st.integers(0, 2 ** 16)),
        seed=draw(st.integers(0, 2 ** 16)),
    )


def run_paged_case(c, backend):
    """Continuous batching on a paged cache: each sequence's last L tokens attend to its own
    ``length`` cached keys, scattered over pages that the sequences reserved in turns; the cache
    slots no sequence owns hold NaN. Compared with attention over each sequence's logical cache."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    B, Hkv, L, page, dtype = c["B"], c["Hkv"], c["L"], c["page"], c["dtype"]
    Hq, E = Hkv * c["G"], 16
    lengths = torch.tensor(c["lengths"])
    S = int(lengths.max())
    n_pages = sum(-(-n // page) for n in c["lengths"]) + c["spare_pages"]
    N = n_pages * page  # logical key positions the converted mods may compute lie in [-page, N)
    masks, scores = catalogues(B, Hq, N)
    masks = {**masks, **KV_BLIND_MASKS}
    positions = lengths - L  # the query rows are each sequence's last L tokens
    inner = masks[c["mask"]] if c["mask"] is not None else None

    def mask_mod(b, h, q_idx, kv_idx):
        in_cache = kv_idx < lengths[b]
        return in_cache if inner is None else in_cache & inner(b, h, q_idx + positions[b], kv_idx)

    score_mod = None
    if c["score"] is not None:
        s_inner = scores[c["score"]]

        def score_mod(score, b, h, q_idx, kv_idx):
            return s_inner(score, b, h, q_idx + positions[b], kv_idx)

    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(B, Hq, L, E, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, S, E, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, S, E, generator=g, dtype=torch.float64).to(dtype)
    paged = PagedAttention(n_pages, page, B, device="cpu")
    order = torch.Generator().manual_seed(c["order_seed"])
    for step in range(1, 4):  # reservations in turns interleave the sequences' pages
        for b in torch.randperm(B, generator=order).tolist():
            paged.reserve(torch.tensor(b), torch.tensor(min(int(lengths[b]), step * int(lengths[b]) // 3 + 1)))
    k_cache = torch.full((1, Hkv, N, E), float("nan"), dtype=dtype)
    v_cache = torch.full((1, Hkv, N, E), float("nan"), dtype=dtype)
    for b, n in enumerate(c["lengths"]):
        paged.assign(torch.tensor([b]), torch.arange(n).view(1, n), k[b:b + 1, :, :n], v[b:b + 1, :, :n], k_cache,
                     v_cache)
    H = Hq if _varies(mask_mod, B, Hq, L, S)[1] else None
    logical = flexc.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=(16, page))
    physical = paged.convert_logical_block_mask(logical)
    ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    spy_target = (decode_cpu, "forward") if backend == "TORCH" else (triton_decode.DecodeLaunch, "__call__")
    if backend == "TRITON" and not triton_decode.applies(q, k_cache, physical):
        return
    with mock.patch.object(*spy_target, autospec=True, side_effect=getattr(*spy_target)) as spy:
        out, lse = flexc.flex_attention(q, k_cache, v_cache, score_mod=paged.get_score_mod(score_mod),
                                        block_mask=physical, enable_gqa=Hq != Hkv, return_lse=True,
                                        kernel_options={"BACKEND": backend})
    assert spy.call_count == 1, f"the {backend} decode path did not run"
    assert_matches(out, lse, ref_out, ref_lse, dtype, f"{backend} on a paged cache",
                   atol=kernel_tolerance(dtype, backend))


@fuzz(16)
@given(paged_cases())
def test_cpu_decode_path_on_a_paged_cache(case):
    run_paged_case(case, "TORCH")


@fuzz(4)
@given(paged_cases(triton=True))
def test_triton_decode_kernel_on_a_paged_cache(case):
    run_paged_case(case, "TRITON")


def test_a_mask_mod_that_ignores_kv_idx_on_several_partial_spans():
    """A one-row mask whose partial blocks (0 and 2) sit on either side of a full one, with a
    mask_mod that reads only q_idx: its verdicts, one column wide, must mask both spans (the CPU
    decode path once sliced the second span out of that one column, got nothing, and let row 1
    attend to block 2: errors of 0.4)."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((1, 2, 2, 16), (1, 2, 64, 16), (1, 2, 64, 16)))

    def first_row_only(b, h, q_idx, kv_idx):
        return q_idx < 1

    table = torch.tensor([[[[0, 2, 1, 3]]]], dtype=torch.int32)
    bm = flexc.BlockMask.from_kv_blocks(torch.tensor([[[2]]], dtype=torch.int32), table,
                                        torch.tensor([[[1]]], dtype=torch.int32), table.roll(-2, -1),
                                        BLOCK_SIZE=16, mask_mod=first_row_only, seq_lengths=(2, 64))

    def meaning(b, h, q_idx, kv_idx):  # block 1 full, blocks 0 and 2 partial, block 3 not listed
        block = kv_idx // 16
        return (block == 1) | (((block == 0) | (block == 2)) & (q_idx < 1))

    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=meaning)
    for backend in ("TORCH", "TRITON"):
        for score_mod in (None, lambda score, b, h, q_idx, kv_idx: score * 1.5):
            ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=meaning)
            out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True,
                                            kernel_options={"BACKEND": backend})
            assert_matches(out, lse, ref_out, ref_lse, torch.float32, f"{backend}, q_idx-only mask_mod")


def test_compiled_decoding_with_a_growing_cache_and_a_block_mask():
    """One compiled attention over a KV cache that grows each step, with a BlockMask: dynamo makes the
    lengths symbolic after the first recompilation, and the compiled call once failed on them
    (InternalTorchDynamoError: SymNodeVariable() is not a constant)."""
    torch._dynamo.reset()
    compiled = torch.compile(flexc.flex_attention)
    g = torch.Generator().manual_seed(11)
    position = torch.tensor(0)  # the query's position, a 0-d tensor as in gpt-fast
    for S in (150, 151, 170):
        q, k, v = (torch.randn(*shape, generator=g) for shape in ((2, 4, 1, 16), (2, 2, S, 16), (2, 2, S, 16)))
        position.fill_(S - 1)
        mask_mod = at_offset(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 100), position)
        bm = flexc.create_block_mask(mask_mod, None, None, 1, S, BLOCK_SIZE=32)
        out, lse = compiled(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
        assert_matches(out, lse, *dense_attention(q, k, v, mask_mod=mask_mod)[:2], torch.float32, f"compiled, S={S}")
