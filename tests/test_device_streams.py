"""A device tensor flexc computes and keeps between calls is served only to the CUDA stream that made
it (``flexc.device.stream_token``): compacted BlockMask tables and derived replays are made again on
another stream, and a value made while a CUDA graph is captured is never served again. On the CPU the
token is None (every cache hits as before); the seam is still asked on the (simulated) device path,
which a spy on it proves here, and its CUDA branch runs against a faked ``torch.cuda``."""
from __future__ import annotations

import pytest
import torch

import flexc
from flexc import device as gpu
from flexc.masks.empty_entries import without_empty_entries
from flexc.mods import derived
from reference import dense_attention, random_qkv


def causal(b, h, q, kv):
    return q >= kv


@pytest.fixture()
def streams(monkeypatch):
    """``(current, asked)``: the stream the spy seam reports now (set ``current[0]``), and the devices it
    was asked about."""
    current, asked = ["A"], []

    def token(device):
        asked.append(device)
        return current[0]

    monkeypatch.setattr(gpu, "stream_token", token)
    return current, asked


def test_the_token_is_none_on_the_cpu_the_current_stream_on_cuda_and_new_while_capturing(monkeypatch):
    cpu = torch.device("cpu")
    assert gpu.stream_token(cpu) is None
    with gpu.simulate("sm_90"):
        assert gpu.stream_token(cpu) is None  # the interpreter runs launches in order: one stream
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: (7, index, 1), raising=False)  # (CPU builds lack it)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
    assert gpu.stream_token(cuda) == (7, 0, 1)  # (stream id, device index, device type), as a Stream compares
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True)
    assert gpu.stream_token(cuda) != gpu.stream_token(cuda)  # a capture's values are never served again


def test_compacted_tables_are_made_again_on_another_stream(streams):
    current, asked = streams
    block_mask = flexc.create_block_mask(causal, 1, 1, 128, 128, BLOCK_SIZE=32)
    with gpu.simulate("sm_90"):  # a GPU compacts every new mask's tables with device ops
        on_a = without_empty_entries(block_mask)
        assert on_a is not block_mask and without_empty_entries(block_mask) is on_a
        assert asked and all(d == torch.device("cpu") for d in asked)
        current[0] = "B"
        on_b = without_empty_entries(block_mask)
        assert on_b is not on_a and without_empty_entries(block_mask) is on_b
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(on_a, name), getattr(on_b, name))


def test_derived_replays_are_made_again_on_another_stream(streams):
    current, asked = streams
    log_temp = torch.tensor(0.3)
    traced = flexc.trace(lambda s, b, h, q, kv: s * torch.exp(log_temp))
    on_a = derived.current(traced)
    assert derived.current(traced) is on_a and asked
    current[0] = "B"
    on_b = derived.current(traced)
    assert on_b is not on_a and derived.current(traced) is on_b
    assert torch.equal(on_a.buffers[0], on_b.buffers[0])


def test_a_simulated_gpu_call_asks_the_seam_and_stays_right_across_streams(streams):
    current, asked = streams
    log_temp = torch.tensor(0.3)
    score = lambda s, b, h, q, kv: s * torch.exp(log_temp)  # noqa: E731
    q, k, v = random_qkv(1, 2, 2, 64, 64, 16, seed=4)
    block_mask = flexc.create_block_mask(causal, None, None, 64, 64, BLOCK_SIZE=32)
    ref = dense_attention(q, k, v, score_mod=score, mask_mod=causal)[0]
    with gpu.simulate("sm_90"):
        for stream in ("A", "B", "A"):
            current[0] = stream
            asked.clear()
            out = flexc.flex_attention(q, k, v, score_mod=score, block_mask=block_mask)
            assert asked  # the device path asked which stream it runs on
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="streams and graphs need a CUDA device")


@cuda_only
def test_calls_on_two_cuda_streams_and_in_a_cuda_graph_see_the_current_captured_values():
    """A derived buffer (``exp(log_temp)``) and compacted tables made on the default stream are made
    again on a side stream and inside a CUDA graph's capture; so the graph recomputes the derived
    buffer on every replay and sees ``log_temp`` edited in place after the capture."""
    log_temp = torch.tensor(0.3, device="cuda")
    score = lambda s, b, h, q, kv: s * torch.exp(log_temp)  # noqa: E731
    q, k, v = random_qkv(1, 2, 2, 1, 256, 64, seed=11)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    block_mask = flexc.create_block_mask(lambda b, h, qi, kv: kv <= 200, None, None, 1, 256, device="cuda")

    def reference():
        ref = dense_attention(q.cpu(), k.cpu(), v.cpu(), mask_mod=lambda b, h, qi, kv: kv <= 200,
                              score_mod=lambda s, b, h, qi, kv: s * torch.exp(log_temp.cpu()))[0]
        return ref

    def step():
        return flexc.flex_attention(q, k, v, score_mod=score, block_mask=block_mask)

    first = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        second = step()
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(first.cpu().double(), reference(), atol=2e-4, rtol=0)
    torch.testing.assert_close(second.cpu().double(), reference(), atol=2e-4, rtol=0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    log_temp.fill_(0.7)  # after the capture: the replay recomputes exp(log_temp)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu().double(), reference(), atol=2e-4, rtol=0)
