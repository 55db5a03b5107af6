"""Decoding's ``block_mask[:, :, index]`` on a GPU (simulated): one gathering op per step, a copy of
the row as torch's slice is, and attention with it equal to float64 dense attention however the
parent's tables change between steps.

References: torch's own BlockMask slicing of torch's create_block_mask, and the float64 dense
attention of tests/reference.py.
"""
import pytest
import torch
from torch.nn.attention import flex_attention as tfa
from torch.utils._python_dispatch import TorchDispatchMode

import flexc
from catalogue import mask_catalogue
from reference import decoding_slice, dense_attention

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


class _CountingOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _assert_slice_equals(ours, ref, what):
    for name in TABLES:
        a, r = getattr(ours, name), getattr(ref, name)
        assert (a is None) == (r is None), (what, name)
        if r is None:
            continue
        assert a.dtype == r.dtype and a.shape == r.shape and a.is_contiguous(), (what, name)
        counts = getattr(ref, name.replace("indices", "num_blocks"))
        used = (torch.arange(r.shape[-1]) < counts.unsqueeze(-1)) if name.endswith("indices") else slice(None)
        assert torch.equal(a[used], r[used]), (what, name)


def test_a_row_sliced_on_a_gpu_is_torchs_slice_gathered_in_one_op():
    B, H, L, S = 2, 2, 300, 520
    mods = mask_catalogue(B, H, L, S)
    with flexc.device.simulate("sm_90"):
        for name in ("causal", "per_head_window", "prefix_lm"):
            ours = flexc.create_block_mask(mods[name], B, H, L, S, BLOCK_SIZE=(64, 128))
            ref = tfa.create_block_mask(mods[name], B, H, L, S, device="cpu", BLOCK_SIZE=(64, 128))
            ours[:, :, torch.tensor([0])]  # (the first slice lays the parent's tables out)
            for row in (*range(ours.kv_num_blocks.shape[2]), -1):
                index = torch.tensor([row])
                with _CountingOps() as counted:
                    sliced = ours[:, :, index]
                assert counted.ops == [torch.ops.aten.index.Tensor], (name, row, counted.ops)
                assert sliced.shape == ref[:, :, index].shape
                _assert_slice_equals(sliced, ref[:, :, index], (name, row))


def test_an_out_of_range_row_raises_as_torch_does():
    with flexc.device.simulate("sm_90"):
        parent = flexc.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256)
        with pytest.raises(IndexError):
            parent[:, :, torch.tensor([2])]


def _step(parent, pos, q, k, v):
    """gpt-fast's decoding step at ``pos``: the slice, a new closure over the position, the call."""
    position = torch.tensor([pos])
    offset = position[0]

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx
    sliced = parent[:, :, position // parent.BLOCK_SIZE[0]]
    sliced.mask_mod, sliced.seq_lengths = mask_mod, (1, k.shape[2])
    return sliced, lambda: flexc.flex_attention(q, k, v, block_mask=sliced)


def test_a_gathered_row_is_a_copy_and_each_step_follows_the_parent_as_it_is_then():
    """Editing the parent after slicing does not reach the slice (torch's slice is a copy); the next
    step's slice sees the edit, made in place or by a ``.data`` swap, and attention follows."""
    torch.manual_seed(0)
    S, pos = 256, 150
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)
    causal = dense_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= pos)[0]
    keys = torch.cat([torch.arange(64), torch.arange(128, pos + 1)])  # full block 1 dropped
    dropped = dense_attention(q, k[:, :, keys], v[:, :, keys])[0]
    with flexc.device.simulate("sm_90"), torch.no_grad():
        parent = flexc.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S, BLOCK_SIZE=64)
        original = parent.full_kv_num_blocks.clone(), parent.full_kv_indices.clone()
        for edit, want_before, want_after in (("in place", causal, dropped), (".data", dropped, causal)):
            sliced, call = _step(parent, pos, q, k, v)
            if edit == "in place":
                parent.full_kv_num_blocks[0, 0, 2] = 1  # keep full block 0 of the row's two
                parent.full_kv_indices[0, 0, 2, 0] = 0
            else:  # the row back as it was, the version counter left alone
                parent.full_kv_num_blocks.data, parent.full_kv_indices.data = (t.clone() for t in original)
            torch.testing.assert_close(call().double(), want_before, atol=1e-5, rtol=0, msg=f"before {edit}")
            _, call = _step(parent, pos, q, k, v)
            torch.testing.assert_close(call().double(), want_after, atol=1e-5, rtol=0, msg=f"after {edit}")
        assert sliced.full_kv_num_blocks.flatten().tolist() == [1]  # the row as it was when sliced


def test_edits_of_a_gathered_slice_are_what_attention_uses():
    torch.manual_seed(1)
    S = 384
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)
    with flexc.device.simulate("sm_90"):
        parent = flexc.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S)
        flexc.flex_attention(q, k, v, block_mask=_step(parent, 300, q, k, v)[0])  # (a plan for the slices)
        sliced, call = _step(parent, 300, q, k, v)
        sliced.full_kv_num_blocks[0, 0, 0] = 1  # keep only key block 0 of the two full ones
        keys = torch.cat([torch.arange(128), torch.arange(256, 301)])
        torch.testing.assert_close(call().double(), dense_attention(q, k[:, :, keys], v[:, :, keys])[0],
                                   atol=1e-5, rtol=0)


def test_a_gathered_slice_crosses_into_a_compiled_function():
    torch.manual_seed(2)
    S = 256
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)

    def attend(q, k, v, mask):
        return flexc.flex_attention(q, k, v, block_mask=mask)
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    with flexc.device.simulate("sm_90"):
        parent = flexc.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S)
        for pos in (130, 200):
            sliced, _ = _step(parent, pos, q, k, v)
            want = dense_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= pos)[0]
            torch.testing.assert_close(compiled(q, k, v, sliced).double(), want, atol=1e-5, rtol=0)


def _windows(b, h, q_idx, kv_idx):
    """A window per batch and head (so each (b, h) has its own row in every table)."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 60 + 70 * h + 45 * b)


def test_warm_steps_pass_the_row_as_every_table_and_equal_dense(monkeypatch):
    """A warm decoding step hands the gathered row itself to the decode kernel as each of its four tables,
    each read at its offset in the row (the kernel's TABLE_OFFSETS), and one scratch tensor as both partial
    results (and the logsumexp when none is returned): at every step of a mask that differs per batch and
    head, attention and its logsumexp equal float64 dense."""
    torch.manual_seed(3)
    B, H, S, block = 2, 2, 384, 64
    q, k, v = torch.randn(B, H, 1, 16), torch.randn(B, H, S, 16), torch.randn(B, H, S, 16)

    position = torch.tensor([0])

    def step(parent, pos):  # (position advanced in place, as gpt-fast's input_pos: the steps share a plan)
        return decoding_slice(parent, position, pos, _windows, S)

    with flexc.device.simulate("sm_90"):
        parent = flexc.create_block_mask(_windows, B, H, S, S, BLOCK_SIZE=block)
        for i, pos in enumerate((100, 127, 128, 129, 250, 383, 0, 64, 65, 300)):
            want = dense_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: _windows(b, h, q_idx + pos, kv_idx))
            if i % 2:  # (a plan of its own, whose warm launch returns the logsumexp the merge writes)
                out, lse = flexc.flex_attention(q, k, v, block_mask=step(parent, pos), return_lse=True)
                torch.testing.assert_close(lse.double(), want[1], atol=1e-5, rtol=0, msg=f"lse at {pos}")
            else:
                out = flexc.flex_attention(q, k, v, block_mask=step(parent, pos))
            torch.testing.assert_close(out.double(), want[0], atol=1e-5, rtol=0, msg=f"position {pos}")
        launches = []
        monkeypatch.setattr(flexc.device, "launch", lambda *args: launches.append(args[:6]))  # (not `fixed`)
        flexc.flex_attention(q, k, v, block_mask=step(parent, 200))
        _, _, spec, _, args, constants = launches[0]  # (the decode kernel's, then the merge's)
        tables = args[5:9]  # (after q, k, v and the two partial results)
        assert all(t is tables[0] for t in tables) and tables[0].shape == (1, 4 + 4 * 6 + 4 + 4 * 6)
        assert (constants["PARTIAL_INDICES_AT"], constants["FULL_COUNTS_AT"], constants["FULL_INDICES_AT"]) == (4, 28, 32)
        merge_args = launches[1][4]
        assert args[3] is args[4] is merge_args[0] is merge_args[1] is merge_args[3]  # (one scratch tensor)


def test_warm_steps_of_one_thread_reuse_one_scratch_tensor_and_another_thread_gets_its_own(monkeypatch):
    """A warm decoding step passes its plan's scratch tensor (the partial results) instead of allocating
    one: every step of the calling thread the same tensor, a step from another thread (which could queue
    its kernels between this thread's decode and merge) a tensor of its own; each step equals float64 dense."""
    import threading

    torch.manual_seed(5)
    B, H, S, block = 1, 2, 256, 64
    q, k, v = torch.randn(B, H, 1, 16), torch.randn(B, H, S, 16), torch.randn(B, H, S, 16)
    position = torch.tensor([0])
    real_launch, scratches = flexc.device.launch, []

    def launch(fn, grid, spec, device, args, *rest):
        if type(spec).__name__ == "DecodeSpec":
            scratches.append(args[3])
        return real_launch(fn, grid, spec, device, args, *rest)

    def step(parent, pos):
        out = flexc.flex_attention(q, k, v, block_mask=decoding_slice(parent, position, pos, _windows, S))
        want = dense_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: _windows(b, h, q_idx + pos, kv_idx))
        torch.testing.assert_close(out.double(), want[0], atol=1e-5, rtol=0, msg=f"position {pos}")

    monkeypatch.setattr(flexc.device, "launch", launch)
    with flexc.device.simulate("sm_90"):
        parent = flexc.create_block_mask(_windows, B, H, S, S, BLOCK_SIZE=block)
        for pos in (10, 70, 200, 130):
            step(parent, pos)
        failed = []
        other = threading.Thread(target=lambda: failed.append(None) or step(parent, 90) or failed.clear())
        other.start()
        other.join()
        assert not failed, "the other thread's step raised"
        step(parent, 40)
    warm = scratches[1:]  # (the first step's launch makes the plan warm)
    assert len(warm) == 5 and all(s is warm[0] for s in warm[:3] + warm[4:]) and warm[3] is not warm[0]
