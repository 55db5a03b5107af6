"""Devices are compared as torch means them (flexc.device.resolve): ``"cuda"`` is the current CUDA
device, ``"cpu:0"`` is the CPU; ``create_block_mask`` builds where the captured tensors live, else on
a usable accelerator, else on the CPU, eagerly and compiled alike; a device it cannot build on is a
clear error. CUDA tensors without a GPU are fake tensors (FakeTensorMode), on the simulated sm_90."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

import flexc
import flexc.device as gpu


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_mask(doc):
    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    return same_document


def test_spellings_of_one_device_resolve_to_it():
    assert gpu.resolve("cpu:0") == gpu.resolve("cpu") == torch.zeros(1).device
    with gpu.simulate("sm_90"):  # the simulated GPU's current index is 0
        assert gpu.resolve("cuda") == torch.device("cuda:0")
        assert gpu.same_device("cuda", torch.device("cuda", 0)) and not gpu.same_device("cuda", "cuda:1")
    with pytest.raises(ValueError, match="create_block_mask: device must be .*got str 'gpu'"):
        flexc.create_block_mask(causal, None, None, 64, 64, device="gpu")


def test_a_cpu_device_spelled_with_its_index_takes_tensors_captured_on_the_cpu():
    doc = torch.arange(64) // 16
    bm = flexc.create_block_mask(document_mask(doc), None, None, 64, 64, device="cpu:0", BLOCK_SIZE=16)
    assert bm.kv_indices.device == doc.device
    assert bm.to_dense().tolist() == flexc.create_block_mask(document_mask(doc), None, None, 64, 64,
                                                             BLOCK_SIZE=16).to_dense().tolist()


def test_cuda_takes_tensors_captured_on_the_current_cuda_device_and_names_another():
    with gpu.simulate("sm_90"), FakeTensorMode():
        doc = torch.zeros(64, dtype=torch.int32, device="cuda")  # .to("cuda") puts it on cuda:0
        assert str(doc.device) == "cuda:0"
        # past the device checks (fake tensors hold no values: the analysis after them stops)
        with pytest.raises(DataDependentOutputException):
            flexc.create_block_mask(document_mask(doc), None, None, 64, 64, device="cuda")
        elsewhere = torch.zeros(64, dtype=torch.int32, device="cuda:1")
        with pytest.raises(ValueError, match=r"'doc' on cuda:1 but it runs on cuda:0\. Fix: .*device='cuda:1'"):
            flexc.create_block_mask(document_mask(elsewhere), None, None, 64, 64, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: CUDA is usable")
def test_cuda_without_a_usable_gpu_is_a_clear_error():
    for build in (flexc.create_block_mask, flexc.create_mask):
        with pytest.raises(ValueError, match=r"device='cuda', but .*Fix: pass device='cpu'"):
            build(causal, None, None, 64, 64, device="cuda")


def test_meta_builds_tables_of_the_shapes_torch_gives():
    from torch.nn.attention import flex_attention as tfa

    ours = flexc.create_block_mask(causal, 2, 1, 256, 200, device="meta")
    theirs = tfa.create_block_mask(causal, 2, 1, 256, 200, device="meta")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        mine, torchs = getattr(ours, name), getattr(theirs, name)
        assert (mine.device.type, mine.shape, mine.dtype) == (torchs.device.type, torchs.shape, torchs.dtype), name


def test_an_accelerator_torch_cannot_use_is_not_the_default(monkeypatch):
    # a CUDA build of torch on a machine without a GPU names CUDA unless asked for a usable one
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: None if check_available else torch.device("cuda"))
    assert flexc.create_block_mask(causal, None, None, 64, 64).kv_indices.device == torch.device("cpu")


def test_eager_and_compiled_build_on_the_same_default_device(monkeypatch):
    monkeypatch.setattr(gpu, "accelerator", lambda: torch.device("meta"))  # a machine whose accelerator is "meta"
    eager = flexc.create_block_mask(causal, None, None, 64, 64)
    compiled = torch.compile(lambda: flexc.create_block_mask(causal, None, None, 64, 64), fullgraph=True)()
    assert eager.kv_indices.device.type == compiled.kv_indices.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_cuda_and_cuda_0_build_one_mask_and_run_one_kernel_with_a_0_d_cpu_capture():
    from reference import dense_attention

    doc = (torch.arange(128) // 48).to("cuda")  # on cuda:0
    offset = torch.tensor(2)  # a 0-d CPU tensor, as torch allows

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx + offset >= kv_idx)
    masks = [flexc.create_block_mask(mask_mod, None, None, 128, 128, device=d, BLOCK_SIZE=64)
             for d in ("cuda", "cuda:0", None)]
    assert all(torch.equal(m.to_dense(), masks[0].to_dense()) for m in masks)
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda") for _ in range(3))
    outs = [flexc.flex_attention(q, k, v, block_mask=m, kernel_options={"BACKEND": "TRITON"}) for m in masks]
    misses = flexc.cache_info().misses
    flexc.flex_attention(q, k, v, block_mask=masks[1], kernel_options={"BACKEND": "TRITON"})
    assert flexc.cache_info().misses == misses  # one kernel for both spellings
    doc_here = doc.cpu()
    ref = dense_attention(q.cpu(), k.cpu(), v.cpu(),
                          mask_mod=lambda b, h, i, j: (doc_here[i] == doc_here[j]) & (i + offset >= j))[0]
    for out in outs:
        torch.testing.assert_close(out.cpu().double(), ref, atol=2e-4, rtol=0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()  # the 0-d capture's device copy is made before capture, not in it
    with torch.cuda.graph(graph):
        captured = flexc.flex_attention(q, k, v, block_mask=masks[0], kernel_options={"BACKEND": "TRITON"})
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, outs[0])
