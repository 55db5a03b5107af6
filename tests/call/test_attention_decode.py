"""Short queries (decoding with a KV cache) on the CPU decode path, against torch's FlexAttention
and the float64 dense reference: every catalogue mask and score_mod, query rows at an offset
into the cache, GQA, batch > 1, ragged per-batch cache lengths, the gpt-fast slicing idiom."""
import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexc
from flexc.backends.cpu import decode_cpu
from catalogue import mask_catalogue, score_catalogue
from reference import dense_attention, random_qkv

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

B, HQ, HKV, S, E = 2, 4, 2, 170, 16  # 170: a ragged last key block
BLOCK = 32
MASKS = mask_catalogue(B, HQ, S, S)  # built for the whole sequence; decoding reads rows at an offset
SCORES = score_catalogue(B, HQ, S, S)


def shifted(mod, offset, score=False):
    """The mod for query rows that sit at ``offset`` in the sequence (q_idx 0 is position offset)."""
    if score:
        return lambda s, b, h, q_idx, kv_idx: mod(s, b, h, q_idx + offset, kv_idx)
    return lambda b, h, q_idx, kv_idx: mod(b, h, q_idx + offset, kv_idx)


def _close(actual, expected, atol=3e-5):
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(MASKS))
def test_every_catalogue_mask_decodes_like_torch_and_dense(name):
    L, offset = 3, 150  # rows 150..152 of a 170-key cache: inside one 32-row block (128..159)
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=3)
    mask_mod = shifted(MASKS[name], offset)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=mask_mod)
    bm = flexc.create_block_mask(mask_mod, B, HQ, L, S, BLOCK_SIZE=BLOCK)
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    _close(out, ref_out)
    _close(lse, ref_lse)
    # the slicing idiom on a whole-sequence mask gives the same rows
    whole = flexc.create_block_mask(MASKS[name], B, HQ, S, S, BLOCK_SIZE=BLOCK)
    sliced = whole[:, :, offset // BLOCK]
    sliced.mask_mod, sliced.seq_lengths = mask_mod, (L, S)
    out2, lse2 = flexc.flex_attention(q, k, v, block_mask=sliced, enable_gqa=True, return_lse=True)
    _close(out2, ref_out)
    _close(lse2, ref_lse)
    # one batch and head: a single table row, served by the per-span plan (mask_mod on partial spans only)
    q1, k1, v1 = q[:1, :1], k[:1, :1], v[:1, :1]
    one_row = flexc.create_block_mask(mask_mod, 1, 1, L, S, BLOCK_SIZE=BLOCK)
    assert decode_cpu._one_row_plan(one_row, L, S, q.device) is not None
    out1, lse1 = flexc.flex_attention(q1, k1, v1, block_mask=one_row, return_lse=True)
    ref_out1, ref_lse1, _ = dense_attention(q1, k1, v1, mask_mod=mask_mod)
    _close(out1, ref_out1)
    _close(lse1, ref_lse1)
    # torch's own FlexAttention on torch's BlockMask
    tbm = torch_flex.create_block_mask(mask_mod, B, HQ, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    t_out, t_lse = torch_flex.flex_attention(q, k, v, block_mask=tbm, enable_gqa=True, return_lse=True)
    _close(out, t_out)
    _close(lse, t_lse)


@pytest.mark.parametrize("name", sorted(SCORES))
def test_every_catalogue_score_mod_decodes_like_torch_and_dense(name):
    L, offset = 1, 169
    q, k, v = random_qkv(B, HQ, HKV, L, S, E, seed=4)
    score_mod = shifted(SCORES[name], offset, score=True)
    mask_mod = shifted(MASKS["causal"], offset)
    bm = flexc.create_block_mask(mask_mod, None, None, L, S, BLOCK_SIZE=BLOCK)
    for block_mask, mm in ((None, None), (bm, mask_mod)):
        out, lse = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                        enable_gqa=True, return_lse=True)
        ref_out, ref_lse, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=mm)
        _close(out, ref_out)
        _close(lse, ref_lse)
    tbm = torch_flex.create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    t_out, t_lse = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=tbm, enable_gqa=True,
                                             return_lse=True)
    _close(out, t_out)
    _close(lse, t_lse)


def test_ragged_cache_lengths_batch_broadcast_and_dead_rows(monkeypatch):
    """Per-batch cache lengths through a captured tensor; a batch with an empty cache gives 0 / -inf."""
    lengths = torch.tensor([170, 70, 0])
    Bq = 3

    def in_cache(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    q, k, v = random_qkv(Bq, 8, 2, 2, S, E, seed=5, Bkv=1)  # key/value batch broadcast
    bm = flexc.create_block_mask(in_cache, Bq, None, 2, S, BLOCK_SIZE=BLOCK)
    calls = []
    original = decode_cpu.forward
    monkeypatch.setattr(decode_cpu, "forward", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    assert calls, "the decode path was not picked for a 2-row query"
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=in_cache)
    _close(out, ref_out)
    _close(lse, ref_lse)
    assert torch.all(out[2] == 0) and torch.all(lse[2] == float("-inf"))
    lengths[1] = 10  # new values in the captured tensor: same trace, new answer
    bm = flexc.create_block_mask(in_cache, Bq, None, 2, S, BLOCK_SIZE=BLOCK)
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    _close(out, dense_attention(q, k, v, mask_mod=in_cache)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_max_scores_and_gradients(dtype):
    L, offset = 4, 100
    q, k, v = random_qkv(1, 4, 4, L, S, E, dtype=dtype, seed=6)
    mask_mod = shifted(MASKS["sliding_window_17"] if "sliding_window_17" in MASKS else MASKS["causal"], offset)
    bm = flexc.create_block_mask(mask_mod, None, None, L, S, BLOCK_SIZE=BLOCK)
    out, aux = flexc.flex_attention(q, k, v, block_mask=bm, return_aux=flexc.AuxRequest(lse=True, max_scores=True))
    ref_out, ref_lse, ref_max = dense_attention(q, k, v, mask_mod=mask_mod)
    atol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-10
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=atol)
    torch.testing.assert_close(aux.lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux.max_scores.double(), ref_max, atol=1e-5, rtol=1e-5)
    if dtype == torch.float64:  # the backward sees the decode forward's lse
        q.requires_grad_()
        flexc.flex_attention(q, k, v, block_mask=bm).sum().backward()
        qr = q.detach().clone().requires_grad_()
        dense_attention(qr, k, v, mask_mod=mask_mod)[0].sum().backward()
        torch.testing.assert_close(q.grad, qr.grad, atol=1e-10, rtol=1e-8)


def test_non_contiguous_blocks_are_gathered():
    """A mask whose listed key blocks are not one range (a document mask over several blocks)."""
    L = 1
    keep = torch.zeros(S, dtype=torch.bool)
    keep[:40] = True
    keep[100:130] = True

    def sparse(b, h, q_idx, kv_idx):
        return keep[kv_idx]

    q, k, v = random_qkv(1, 2, 2, L, S, E, seed=7)
    bm = flexc.create_block_mask(sparse, None, None, L, S, BLOCK_SIZE=32)
    positions, start, _, _ = decode_cpu._visited_positions(bm, L, S, q.device)
    assert start is None and positions.numel() == 4 * 32  # blocks 0, 1 (keys 0..39), 3, 4 (100..129)
    out, lse = flexc.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=sparse)
    _close(out, ref_out)
    _close(lse, ref_lse)


def _window(size):
    return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < size)


@pytest.mark.parametrize("position", [63, 64, 95, 100, 127, 169])
@pytest.mark.parametrize("L", [1, 4])
def test_partial_blocks_the_rows_see_whole_are_trimmed_or_unmasked(position, L, monkeypatch):
    # a sliding window sliced for a decoding step: its partial blocks may be entirely allowed or
    # entirely blocked for these few rows (then no mask, or the keys are not read at all) or mixed
    window = 2 * BLOCK
    offset = position - L + 1
    mask_mod = shifted(_window(window), offset)
    q, k, v = random_qkv(1, HQ, HKV, L, S, E, seed=position)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=mask_mod)
    whole = flexc.create_block_mask(_window(window), None, None, S, S, BLOCK_SIZE=BLOCK)
    sliced = whole[:, :, torch.tensor([offset // BLOCK])] if offset // BLOCK == position // BLOCK else None
    if sliced is None:  # the rows straddle two query blocks: a mask built for them
        sliced = flexc.create_block_mask(mask_mod, None, None, L, S, BLOCK_SIZE=BLOCK)
    else:
        sliced.mask_mod, sliced.seq_lengths = mask_mod, (L, S)
    # keys the window excludes hold NaN: they must contribute nothing, whether read or trimmed
    k, v = k.clone(), v.clone()
    k[:, :, position + 1:] = float("nan")
    v[:, :, : max(0, offset - window + 1)] = float("nan")
    calls = []
    monkeypatch.setattr(decode_cpu, "flash", lambda *a: calls.append(a) or flash(*a))
    out, lse = flexc.flex_attention(q, k, v, block_mask=sliced, enable_gqa=True, return_lse=True)
    _close(out, ref_out)
    _close(lse, ref_lse)
    if L == 1:  # one row: the range is narrowed to the window's keys, with no mask (nor NaN) left
        (_, k_sel, _, masked, *_), = calls
        assert masked == [] and k_sel.shape[2] == min(window, position + 1)


flash = decode_cpu.flash


def test_inference_mode_tensors_without_write_counters_decode_and_prefill():
    # tensors made under torch.inference_mode() have no version counter: the caches keyed by one
    # (validated tables, proven lookups, table contents) must fall back to redoing their work
    bias = torch.randn(HQ)
    score_mod = lambda s, b, h, q_idx, kv_idx: s + bias[h]  # noqa: E731
    with torch.inference_mode():
        whole = flexc.create_block_mask(_window(48), None, None, S, S, BLOCK_SIZE=BLOCK)
        q, k, v = random_qkv(1, HQ, HKV, S, S, E, seed=11)
        out = flexc.flex_attention(q, k, v, score_mod=score_mod, block_mask=whole, enable_gqa=True)
        step = whole[:, :, torch.tensor([150 // BLOCK])]
        step.mask_mod, step.seq_lengths = shifted(_window(48), 150), (1, S)
        out_step = flexc.flex_attention(q[:, :, 150:151], k, v, score_mod=score_mod, block_mask=step,
                                        enable_gqa=True)
    ref, _, _ = dense_attention(q, k, v, score_mod=score_mod, mask_mod=_window(48))
    _close(out, ref)
    _close(out_step, ref[:, :, 150:151])


@pytest.mark.parametrize("B, Hq, Hkv, L, position, window", [
    (1, 4, 4, 1, 200, 300), (2, 4, 4, 1, 150, 40), (1, 4, 4, 1, 95, 10), (2, 4, 4, 1, 255, 1000),
    (1, 8, 2, 1, 200, 60), (2, 8, 2, 3, 130, 50), (1, 4, 4, 5, 100, 40)])
def test_short_queries_as_two_batched_products_equal_the_reference(monkeypatch, B, Hq, Hkv, L, position, window):
    """Large short-query calls run as two batched products instead of the fused kernel: one or
    several rows, GQA heads stacked per key head, batches, masked partial columns and the
    logsumexp as the reference (and torch)."""
    S = 256
    monkeypatch.setattr(decode_cpu, "PRODUCTS_MIN_KEY_ELEMENTS", 1)  # every call large enough
    calls = []
    products = decode_cpu.two_products
    monkeypatch.setattr(decode_cpu, "two_products", lambda *a: calls.append(a) or products(*a))
    offset = position - L + 1
    mask_mod = shifted(_window(window), offset)
    q, k, v = random_qkv(B, Hq, Hkv, L, S, E, seed=position)
    whole = flexc.create_block_mask(_window(window), None, None, S, S, BLOCK_SIZE=BLOCK)
    assert offset // BLOCK == position // BLOCK  # (the rows lie in one query block)
    step = whole[:, :, torch.tensor([offset // BLOCK])]
    step.mask_mod, step.seq_lengths = mask_mod, (L, S)
    out, lse = flexc.flex_attention(q, k, v, block_mask=step, return_lse=True, enable_gqa=True)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=mask_mod)
    _close(out, ref_out)
    _close(lse, ref_lse)
    torch_mask = torch_flex.create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=BLOCK)
    _close(out, torch_flex.flex_attention(q, k, v, block_mask=torch_mask, enable_gqa=True).double())
    assert len(calls) == 1  # (the products ran, not the fused kernel)


def test_two_products_mask_the_columns_a_striped_mask_blocks(monkeypatch):
    """A mask with holes inside its partial blocks leaves masked columns after narrowing: they get
    -inf before the softmax, and keys listed in full blocks stay allowed."""
    S, H, position = 256, 2, 180
    monkeypatch.setattr(decode_cpu, "PRODUCTS_MIN_KEY_ELEMENTS", 1)
    calls = []
    products = decode_cpu.two_products
    monkeypatch.setattr(decode_cpu, "two_products", lambda *a: calls.append(a) or products(*a))

    def striped(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx % 3 != 0) | (kv_idx < 64))

    q, k, v = random_qkv(1, H, H, 1, S, E, seed=3)
    whole = flexc.create_block_mask(striped, None, None, S, S, BLOCK_SIZE=BLOCK)
    step = whole[:, :, torch.tensor([position // BLOCK])]
    step.mask_mod, step.seq_lengths = shifted(striped, position), (1, S)
    out, lse = flexc.flex_attention(q, k, v, block_mask=step, return_lse=True)
    ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=shifted(striped, position))
    _close(out, ref_out)
    _close(lse, ref_lse)
    (_, _, _, masked, *_), = calls
    assert masked  # (the striped blocks' columns were masked, not narrowed away)


def test_a_simulated_gpu_decodes_every_catalogue_mask_on_the_torch_backend_without_host_copies():
    """On a GPU the one-row plan masks every partial span on the device (its verdicts are not read
    on the host, which would sync and copy both ways every call): same results, nothing counted."""
    from host_reads import counting_host_reads

    L, offset = 3, 150
    q, k, v = random_qkv(1, 1, 1, L, S, E, seed=4)
    with flexc.device.simulate("sm_90"):
        for name in sorted(MASKS):
            mask_mod = shifted(MASKS[name], offset)
            one_row = flexc.create_block_mask(mask_mod, 1, 1, L, S, BLOCK_SIZE=BLOCK)
            call = lambda: flexc.flex_attention(q, k, v, block_mask=one_row, return_lse=True,
                                                kernel_options={"BACKEND": "TORCH"})
            call()
            with counting_host_reads() as reads:
                out, lse = call()
            assert reads == [], f"{name}: {reads}"
            ref_out, ref_lse, _ = dense_attention(q, k, v, mask_mod=mask_mod)
            _close(out, ref_out)
            _close(lse, ref_lse)
    # an uninitialised cache past the causal rows: NaN and inf in masked keys' values stay out
    causal = shifted(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, offset)
    bad_v = v.clone()
    bad_v[..., 160, :], bad_v[..., 165, :] = float("nan"), float("inf")
    with flexc.device.simulate("sm_90"):
        mask = flexc.create_block_mask(causal, 1, 1, L, S, BLOCK_SIZE=BLOCK)
        out = flexc.flex_attention(q, k, bad_v, block_mask=mask, kernel_options={"BACKEND": "TORCH"})
    _close(out, dense_attention(q, k, v, mask_mod=causal)[0])
