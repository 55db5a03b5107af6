"""Exact tile evaluation (flexc.analysis.tiles.evaluate_tiles): on worker threads it gives exactly the
serial classes, whatever the batch size; slow runs report their progress on stderr, fast ones stay
silent, and ``FLEXC_PROGRESS=0`` silences it.
"""
import io

import pytest
import torch
from hypothesis import given, strategies as st

import flexc
import flexc.workers as workers
from flexc.analysis import tiles
from flexc.analysis.tiles import FULL, PARTIAL, evaluate_tiles, ragged_tiles
from reference import exact_classes
from strategies import TILE_MASKS, compile_mod, examples, mask_source


def _tables(seed):
    g = torch.Generator().manual_seed(seed)
    names = {"t0": torch.randint(-20, 20, (9,), generator=g), "t1": torch.arange(64) // 8,
             "t2": torch.sort(torch.randint(0, 6, (50,), generator=g)).values,
             "bt0": torch.rand(40, generator=g) < 0.5, "bt1": torch.rand(7, generator=g) < 0.9}
    return names


def _all_tiles(B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK):
    return torch.ones(B, H, tiles.cdiv(Q_LEN, Q_BLOCK), tiles.cdiv(KV_LEN, KV_BLOCK), dtype=torch.bool).nonzero()


def _expected(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK):
    """The classes evaluate_tiles gives every tile, from the dense mask: ragged tiles are never FULL."""
    exact = exact_classes(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    ragged = ragged_tiles(Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    return torch.where((exact == FULL) & ragged, PARTIAL, exact).flatten()


@examples(60)
@given(data=st.data(), seed=st.integers(0, 3), B=st.integers(1, 2), H=st.integers(1, 3),
       Q_LEN=st.integers(1, 90), KV_LEN=st.integers(1, 90), Q_BLOCK=st.sampled_from([1, 3, 8, 16, 32]),
       KV_BLOCK=st.sampled_from([1, 5, 8, 16, 64]), tiles_per_batch=st.integers(1, 5),
       n_workers=st.integers(2, 4))
def test_parallel_evaluation_gives_the_serial_classes(data, seed, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK,
                                                      tiles_per_batch, n_workers):
    traced = flexc.trace(compile_mod(mask_source(data.draw(TILE_MASKS.expressions("bool"))), _tables(seed)))
    coords = _all_tiles(B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)
    serial = evaluate_tiles(traced, coords, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, n_workers=1)
    elements = min(Q_BLOCK, Q_LEN) * min(KV_BLOCK, KV_LEN) * tiles_per_batch
    parallel = evaluate_tiles(traced, coords, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, max_elements=elements,
                              n_workers=n_workers)
    assert serial.dtype == parallel.dtype == torch.int8
    assert torch.equal(serial, parallel), str(traced)
    assert torch.equal(serial, _expected(traced, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK)), str(traced)


@pytest.mark.parametrize("seed", range(3))
def test_random_data_mask_on_workers_gives_the_serial_and_torch_tables(seed, monkeypatch):
    """A mask over a captured random tensor, which analysis cannot decide, through create_block_mask
    with many small batches on three workers."""
    keep = torch.rand(700, generator=torch.Generator().manual_seed(seed)) > 0.3

    def random_keep(b, h, q_idx, kv_idx):
        return keep[q_idx] & keep[kv_idx] | (q_idx >= kv_idx)

    def hashed(b, h, q_idx, kv_idx):
        return ((q_idx * 7919 + kv_idx * 104729 + h) % 13) != 0

    evaluate = tiles.evaluate_tiles
    for mod, H in ((random_keep, 1), (hashed, 2)):
        serial = flexc.create_block_mask(mod, 1, H, 700, 700, device="cpu", BLOCK_SIZE=16)
        calls = []

        def on_workers(*args, **kwargs):
            calls.append(1)
            return evaluate(*args, **{**kwargs, "max_elements": 3 * 16 * 16, "n_workers": 3})

        monkeypatch.setattr("flexc.masks.create.evaluate_tiles", on_workers)
        parallel = flexc.create_block_mask(mod, 1, H, 700, 700, device="cpu", BLOCK_SIZE=16)
        monkeypatch.undo()
        assert calls
        ref = torch.nn.attention.flex_attention.create_block_mask(mod, 1, H, 700, 700, device="cpu", BLOCK_SIZE=16)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(serial, name), getattr(parallel, name)), name
            assert torch.equal(getattr(serial, name), getattr(ref, name)), name


@examples(80)
@given(n=st.integers(1, 5), rows=st.integers(1, 9), cols=st.integers(1, 17), p=st.sampled_from([0.0, 0.5, 0.97, 1.0]),
       expand=st.booleans(), seed=st.integers(0, 100))
def test_any_all_in_one_reduction_equals_any_and_all(n, rows, cols, p, expand, seed):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(n, 1 if expand else rows, cols, generator=g) < p
    if expand:  # a mod that ignores q_idx: evaluate broadcasts its result
        allowed = allowed.expand(n, rows, cols)
    any_allowed, all_allowed = tiles._any_all(allowed, n)
    assert torch.equal(any_allowed, allowed.reshape(n, -1).any(1))
    assert torch.equal(all_allowed, allowed.reshape(n, -1).all(1))
    offset = torch.ones(n * rows * cols + 1, dtype=torch.bool)[1:].view(n, rows, cols)  # not word-aligned
    assert torch.equal(tiles._any_all(offset, n)[1], torch.ones(n, dtype=torch.bool))


def test_worker_count_is_one_for_a_few_batches(monkeypatch):
    seen = []
    run = workers.run
    monkeypatch.setattr(workers, "run", lambda tasks, costs, fn, n, **k: (seen.append(n), run(tasks, costs, fn, n, **k)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    traced = flexc.trace(lambda b, h, q_idx, kv_idx: (q_idx * 3 + kv_idx) % 5 != 0)
    coords = _all_tiles(1, 1, 64, 64, 8, 8)  # 64 tiles
    evaluate_tiles(traced, coords, 64, 64, 8, 8, max_elements=8 * 8 * 32)  # 2 batches
    evaluate_tiles(traced, coords, 64, 64, 8, 8, max_elements=8 * 8)  # 64 batches
    assert seen == [1, 4]


def test_a_failing_batch_raises_and_stops_the_other_workers():
    done = []

    def fn(task, worker):
        if task == 0:
            raise IndexError("out of range")
        done.append(task)

    with pytest.raises(IndexError, match="out of range"):
        workers.run(list(range(200)), [1.0] * 200, fn, 2, dynamic=True)
    assert len(done) < 199


# ---- progress ----------------------------------------------------------------------------------

def _slow_evaluation(monkeypatch, after_s=-1.0):
    """An evaluation of 64 one-tile batches that counts as slow from the start (threshold patched)."""
    monkeypatch.setattr(workers, "PROGRESS_AFTER_S", after_s)

    def every_fifth(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx) % 5 != 0

    traced = flexc.trace(every_fifth)
    return evaluate_tiles(traced, _all_tiles(1, 1, 64, 64, 8, 8), 64, 64, 8, 8, max_elements=8 * 8, n_workers=2)


def test_a_slow_evaluation_reports_its_progress(monkeypatch, capsys):
    monkeypatch.delenv("FLEXC_PROGRESS", raising=False)
    _slow_evaluation(monkeypatch)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert all("create_block_mask: evaluating every_fifth tile by tile" in line for line in lines), err
    assert 3 <= len(lines) <= 12, err  # not a line per batch: one per 10% on a non-terminal
    assert "tiles (" in lines[0] and "left" in lines[0], err
    assert lines[-1].startswith("flexc:") and "64/64 tiles (100%) in " in lines[-1], err
    assert sum("(100%)" in line for line in lines) == 1, err
    assert "\r" not in err


def test_a_fast_evaluation_prints_nothing(monkeypatch, capsys):
    monkeypatch.delenv("FLEXC_PROGRESS", raising=False)
    flexc.create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx * 7 + kv_idx) % 3 != 0, 1, 1, 512, 512, device="cpu")
    _slow_evaluation(monkeypatch, after_s=60.0)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("value", ["0", "off"])
def test_flexc_progress_0_silences_the_report(monkeypatch, capsys, value):
    monkeypatch.setenv("FLEXC_PROGRESS", value)
    _slow_evaluation(monkeypatch)
    assert capsys.readouterr().err == ""


def test_a_nearly_done_run_starts_no_report(monkeypatch):
    monkeypatch.delenv("FLEXC_PROGRESS", raising=False)
    stream = io.StringIO()
    progress = workers.Progress("job", 10, after_s=-1.0, stream=stream)
    with progress:
        progress.advance(9)  # 90% done when first due: about to finish
        progress.advance(1)
    assert stream.getvalue() == ""


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_one_line_is_updated_in_place(monkeypatch):
    monkeypatch.delenv("FLEXC_PROGRESS", raising=False)
    monkeypatch.setattr(workers, "TTY_INTERVAL_S", 0.0)
    stream = _Terminal()
    with workers.Progress("evaluating m", 100, after_s=-1.0, stream=stream) as progress:
        for _ in range(50):
            progress.advance(2)
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, ended by the final report
    updates = text.split("\r")[1:]
    assert len(updates) == 50  # every advance but the last (no interval), then the final line
    assert updates[0].startswith("flexc: evaluating m: 2/100 tiles (2%), about ")
    assert updates[-1].startswith("flexc: evaluating m: 100/100 tiles (100%) in ")


def test_on_a_terminal_updates_are_rate_limited(monkeypatch):
    monkeypatch.delenv("FLEXC_PROGRESS", raising=False)
    stream = _Terminal()
    with workers.Progress("evaluating m", 1000, after_s=-1.0, stream=stream) as progress:
        for _ in range(1000):
            progress.advance(1)
    assert stream.getvalue().count("\r") == 2  # the first update and the final line (a fast loop)


def test_a_failed_run_ends_the_in_place_line_without_a_final_report(monkeypatch):
    monkeypatch.delenv("FLEXC_PROGRESS", raising=False)
    stream = _Terminal()
    with pytest.raises(RuntimeError):
        with workers.Progress("evaluating m", 10, after_s=-1.0, stream=stream) as progress:
            progress.advance(1)
            raise RuntimeError
    assert stream.getvalue().endswith("left\033[K\n") and "100%" not in stream.getvalue()
