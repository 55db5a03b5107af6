"""The generated-kernel cache: keyed by the mods' structure, dtypes, head dims, block sizes and
options, so new captured values, sequence lengths and batch sizes reuse one compiled kernel."""
from __future__ import annotations

import inspect
import os
import threading
import uuid

import pytest
import torch

import flexc
import flexc.codegen
from flexc.backends.triton import cache as kernel_cache, forward as triton_forward
from reference import dense_attention

TRITON = {"BACKEND": "TRITON"}


def make_mods(B: int, L: int, seed: int):
    """An ALiBi score_mod and a document mask over freshly made captured tensors."""
    g = torch.Generator().manual_seed(seed)
    slopes = torch.rand(2, generator=g)
    lengths = torch.randint(1, max(2, L // 2), (L,), generator=g)
    document = torch.repeat_interleave(torch.arange(L), lengths)[:L]

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def same_document(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    return alibi, same_document


def run(B, L, seed, dtype=torch.float32, return_lse=True):
    alibi, same_document = make_mods(B, L, seed)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, 2, L, 16, generator=g).to(dtype) for _ in range(3))
    block_mask = flexc.create_block_mask(same_document, B, None, L, L, device="cpu", BLOCK_SIZE=32)
    out = flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask, return_lse=return_lse,
                               kernel_options=TRITON)
    out = out[0] if return_lse else out
    ref, _, _ = dense_attention(q, k, v, score_mod=alibi, mask_mod=same_document)
    torch.testing.assert_close(out.double(), ref, atol=2e-5 if dtype == torch.float32 else 3e-2, rtol=0)


def test_new_captured_values_lengths_and_batch_sizes_compile_once():
    flexc.cache_clear()
    for B, L, seed in ((1, 64, 0), (2, 96, 1), (3, 50, 2), (1, 130, 3)):
        run(B, L, seed)  # each call checks its answer, so the new captured values were used
    info = flexc.cache_info()
    assert (info.misses, info.hits, info.size) == (1, 3, 1)


def test_new_structure_dtype_or_outputs_compile_again():
    flexc.cache_clear()
    run(1, 64, 0)
    run(1, 64, 0, dtype=torch.bfloat16)
    run(1, 64, 0, return_lse=False)
    q = k = v = torch.randn(1, 2, 64, 16)
    flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s * 0.5, kernel_options=TRITON)
    flexc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s * 0.25, kernel_options=TRITON)  # constants differ
    assert flexc.cache_info().misses == 5


def test_concurrent_first_calls_compile_once():
    flexc.cache_clear()
    errors = []

    def worker(seed):
        try:
            run(1, 64, seed)
        except Exception as e:  # surfaced below with the failing thread's error
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    info = flexc.cache_info()
    assert (info.misses, info.hits) == (1, 3)


def test_kernel_source_is_the_cached_file_that_runs():
    flexc.cache_clear()
    alibi, same_document = make_mods(1, 64, 0)
    q = k = v = torch.randn(1, 2, 64, 16)
    block_mask = flexc.create_block_mask(same_document, 1, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    flexc.flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask, kernel_options=TRITON)
    source = flexc.kernel_source(q, k, v, score_mod=alibi, block_mask=block_mask, kernel_options=TRITON)
    assert flexc.cache_info().misses == 1  # kernel_source compiled nothing new
    spec = triton_forward.make_spec(flexc.trace(alibi), flexc.trace(same_document), torch.float32, 16, 16,
                                    (32, 32), None, "interpreter", False,
                                    float_indices=True)  # as the call's layout decides for its extents
    with open(kernel_cache.get_kernel(spec).path) as f:
        assert f.read() == source
    assert source.startswith("# flexc forward attention kernel")
    assert "#   score_mod alibi: score + slopes[h] * (kv_idx - q_idx)" in source
    assert "#   mask_mod  same_document: (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)" in source
    assert "slopes_ptr, slopes_stride_0" in source and "document_ptr, document_stride_0" in source


def test_a_kernel_runs_after_another_process_deleted_its_source_file(tmp_path, monkeypatch):
    """Processes sharing the cache directory each delete the files of the kernels they drop
    (cache_clear): a kernel another process imported from that file keeps its source, which Triton
    reads at the first launch, and runs."""
    monkeypatch.setenv("FLEXC_CACHE_DIR", str(tmp_path))
    source = (f"# {uuid.uuid4().hex}\nimport triton\nimport triton.language as tl\n\n\n@triton.jit\n"
              "def plus_one(x):\n    return x + 1\n\n\n@triton.jit\ndef kernel(X):\n"
              "    tl.store(X, plus_one(tl.load(X)))\n")
    module, path = kernel_cache.import_source(source, "interpreter")
    os.remove(path)  # (the other process's cache_clear)
    # what Triton reads at the first launch (its interpreter rewrites each jit function from its source;
    # one it cannot read runs unrewritten, or raises if the file goes between its two reads)
    assert inspect.getsourcelines(module.plus_one.fn)[0][1].startswith("def plus_one")
    x = torch.zeros(1)
    module.kernel[(1,)](x)
    assert x.item() == 1


def test_cache_directory_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXC_CACHE_DIR", str(tmp_path))
    flexc.cache_clear()
    run(1, 40, 5)
    assert any(p.name.startswith("flexc_kernel_") and p.suffix == ".py" for p in tmp_path.iterdir())


def test_out_of_shared_memory_retries_with_smaller_tiles_and_remembers(monkeypatch):
    """On a GPU, a launch that needs more shared memory than exists is retried with fewer stages,
    then smaller tiles; the replacement is remembered for later calls and for kernel_source."""
    from triton.runtime.errors import OutOfResources

    flexc.cache_clear()
    launched = []

    class FakeKernel:
        def __init__(self, spec, device=None, key=None):
            self.generated = flexc.codegen.generate_forward(spec)
            self.spec = spec
            self.fn = self

        def __getitem__(self, grid):
            def run(*args, num_warps, num_stages, **constants):
                launched.append((constants["BLOCK_M"], constants["BLOCK_N"], num_stages))
                if num_stages > 1 or constants["BLOCK_N"] > 32:
                    raise OutOfResources(300000, 232448, "shared memory")
            return run

    monkeypatch.setattr(kernel_cache, "get_kernel", FakeKernel)
    spec = triton_forward.make_spec(None, None, torch.bfloat16, 64, 64, None, None, "cuda", False)
    assert (spec.block_m, spec.block_n, spec.num_stages) == (128, 128, 3)
    q = k = v = torch.zeros(1, 1, 256, 64, dtype=torch.bfloat16)
    with flexc.device.simulate("sm_90"):  # the GPU's launch code, on CPU tensors
        with pytest.warns(flexc.FallbackWarning, match="runs with BLOCK_M=128, BLOCK_N=32, num_stages=1 from now on"):
            triton_forward.launch(spec, q, k, v, None, None, None, 0.125)
        assert launched == [(128, 128, 3), (128, 128, 2), (128, 128, 1), (128, 64, 2), (128, 64, 1), (128, 32, 2),
                            (128, 32, 1)]
        launched.clear()
        triton_forward.launch(spec, q, k, v, None, None, None, 0.125)
        assert "BLOCK_M=128, BLOCK_N=32; num_warps=4, num_stages=1" in kernel_cache.source_for(spec, q.device)
    assert launched == [(128, 32, 1)]  # straight to the configuration that fits
