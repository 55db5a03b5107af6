"""flexc.plot and its raster: checked against torch's create_mask / create_block_mask and direct calls of the mods."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import flex_attention as tfa

pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402
import numpy as np  # noqa: E402

import flexc  # noqa: E402
from catalogue import mask_catalogue, score_catalogue  # noqa: E402
from flexc.tools.plot import COLORS, EMPTY, FULL, LABELS, PARTIAL_ALLOWED, PARTIAL_MASKED, raster  # noqa: E402
from reference import index_tensors  # noqa: E402
from repo import ROOT
from torch_api import torch_tile_classes



def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("name", ["document_causal", "per_head_window", "padding_per_batch", "strided_keys_every_4"])
def test_raster_shows_every_element_as_torch_masks_it_and_tiles_as_torch_classifies_them(name):
    B, H, L, S, block = 2, 3, 200, 330, 64
    mod = mask_catalogue(B, H, L, S)[name]
    allowed = tfa.create_mask(mod, B, H, L, S, device="cpu")
    ref = tfa.create_block_mask(mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)
    classes = torch_tile_classes(ref)
    block_mask = flexc.create_block_mask(mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)
    for b, h in ((0, 0), (1, 2)):
        r = raster(block_mask, batch=b, head=h)
        assert r.codes.shape == (L, S)
        assert torch.equal((r.codes == FULL) | (r.codes == PARTIAL_ALLOWED), allowed[b, h]), (name, b, h)
        tile = classes[b, h].repeat_interleave(block, 0).repeat_interleave(block, 1)[:L, :S]
        assert torch.equal(r.codes == FULL, tile == 2), (name, b, h)
        assert torch.equal(r.codes == EMPTY, tile == 0), (name, b, h)


def test_long_sequences_are_sampled_at_cell_centres():
    L, S, cells = 1000, 700, 64
    mod = mask_catalogue(1, 1, L, S)["sliding_window_256"]
    r = raster(flexc.create_block_mask(mod, None, None, L, S, device="cpu", BLOCK_SIZE=128), max_pixels=cells)
    assert r.codes.shape == (cells, cells)
    # cell i covers [i * L / cells, (i + 1) * L / cells): its centre, rounded down
    assert r.q_pos.tolist() == [int((i + 0.5) * L / cells) for i in range(cells)]
    allowed = tfa.create_mask(mod, 1, 1, L, S, device="cpu")[0, 0]
    shown = (r.codes == FULL) | (r.codes == PARTIAL_ALLOWED)
    assert torch.equal(shown, allowed[r.q_pos][:, r.kv_pos])


def test_score_mod_heat_map_values_are_the_mod_of_a_zero_score_masked_where_the_mask_masks():
    B, H, L, S = 1, 4, 96, 160
    mods = score_catalogue(B, H, L, S)
    for name in ("t5_bucketed_bias", "alibi_captured_slopes", "soft_capping_tanh"):
        block_mask = flexc.create_block_mask(causal, None, None, L, S, device="cpu", BLOCK_SIZE=32)
        r = raster(block_mask, score_mod=mods[name], head=3)
        b, h, q, kv = index_tensors(B, H, L, S)
        expected = mods[name](torch.zeros((), dtype=torch.float64), b, h, q, kv)
        expected = torch.broadcast_to(expected, (B, H, L, S))[0, 3].to(torch.float64)
        keep = (q >= kv)[0, 0]
        assert torch.equal(r.values.isnan(), ~keep), name
        torch.testing.assert_close(r.values[keep], expected[keep], rtol=1e-6, atol=1e-6, msg=name)


def _pixel(fig, ax, q, kv):
    """RGB (0-255) of the rendered figure at element (q, kv)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    image = torch.from_numpy(np.asarray(canvas.buffer_rgba()).copy())
    x, y = ax.transData.transform((kv, q))
    return tuple(image[int(round(image.shape[0] - y)), int(round(x)), :3].tolist())


def _rgb(hex_color):
    return tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))


def test_known_tiles_of_a_causal_mask_have_their_colours_and_the_legend_names_them(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 6), dpi=100)
    ax = fig.add_subplot()
    assert flexc.plot(causal, Q_LEN=256, BLOCK_SIZE=64, ax=ax) is fig
    assert _pixel(fig, ax, 160, 20) == _rgb(COLORS[FULL])             # tile (2, 0): below the diagonal
    assert _pixel(fig, ax, 20, 200) == _rgb(COLORS[EMPTY])            # tile (0, 3): above it
    assert _pixel(fig, ax, 120, 70) == _rgb(COLORS[PARTIAL_ALLOWED])  # tile (1, 1), q >= kv
    assert _pixel(fig, ax, 70, 120) == _rgb(COLORS[PARTIAL_MASKED])   # tile (1, 1), q < kv
    assert len(set(COLORS.values())) == 4
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [LABELS[c] for c in
                                                                   (FULL, PARTIAL_ALLOWED, PARTIAL_MASKED, EMPTY)]


def test_plot_writes_a_png_of_the_requested_size_for_block_masks_from_flexc_and_torch(tmp_path):
    mod = mask_catalogue(2, 2, 300, 300)["per_head_window"]
    ours = flexc.create_block_mask(mod, 2, 2, 300, 300, device="cpu", BLOCK_SIZE=64)
    theirs = tfa.create_block_mask(mod, 2, 2, 300, 300, device="cpu", BLOCK_SIZE=64)
    for i, block_mask in enumerate((ours, theirs)):
        path = tmp_path / f"mask{i}.png"
        flexc.plot(block_mask, head=1, path=str(path), dpi=50)
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[:2] == (280, 320)  # figsize (6.4, 5.6) inches at 50 dpi
    assert (tmp_path / "mask0.png").read_bytes() == (tmp_path / "mask1.png").read_bytes()


def test_plot_rejects_bad_selections_and_says_how_to_fix_them():
    block_mask = flexc.create_block_mask(causal, 2, 1, 128, 128, device="cpu")
    with pytest.raises(ValueError, match=r"batch=2 is out of range for a BlockMask with 2 batches"):
        raster(block_mask, batch=2)
    with pytest.raises(ValueError, match="max_pixels must be an int >= 1"):
        raster(block_mask, max_pixels=0)
    with pytest.raises(TypeError, match="expected a BlockMask, a mask_mod or a score_mod"):
        flexc.plot(42)
    with pytest.raises(ValueError, match="already carries its mask_mod"):
        flexc.plot(block_mask, mask_mod=causal)


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.colors", None)
    with pytest.raises(ImportError, match=r"pip install 'flexc\[plot\]'"):
        flexc.plot(causal, Q_LEN=64)


def test_a_65536_long_mask_is_drawn_without_allocating_l_by_s(tmp_path):
    # L x S bools would be 4 GiB; the picture needs a 1024 x 1024 raster. Peak RSS of a fresh
    # process, before and after drawing, bounds what plot() allocated.
    script = (
        "import resource, torch, flexc, matplotlib.figure\n"
        "def causal(b, h, q_idx, kv_idx):\n"
        "    return q_idx >= kv_idx\n"
        "def alibi(score, b, h, q_idx, kv_idx):\n"
        "    return score + (kv_idx - q_idx) * 0.01\n"
        "flexc.plot(causal, Q_LEN=128, BLOCK_SIZE=64, path='warm.png', dpi=30)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "bm = flexc.create_block_mask(causal, None, None, 65536, 65536, device='cpu')\n"
        "flexc.plot(bm, path='long.png')\n"
        "flexc.plot(alibi, None, None, 65536, mask_mod=bm, path='long_score.png')\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    grown_mib = int(done.stdout.split()[-1])
    print(f"peak RSS grew by {grown_mib} MiB drawing a 65536 x 65536 mask and score_mod")
    assert grown_mib < 400, f"peak memory grew by {grown_mib} MiB"
    assert (tmp_path / "long.png").stat().st_size > 1000 and (tmp_path / "long_score.png").stat().st_size > 1000


def test_block_mask_text_view_is_torchs_line_for_line_with_partial_tiles_marked():
    from torch.nn.attention import flex_attention as tfa

    ours = str(flexc.create_block_mask(causal, None, None, 512, 384, device="cpu")).splitlines()
    theirs = str(tfa.create_block_mask(causal, None, None, 512, 384, device="cpu")).splitlines()
    # torch's lines in number and order; partial tiles drawn ░░ (not ██)
    assert any("░░" in line for line in ours)
    assert [line.replace("░", "█") for line in ours] == theirs


def test_torchs_block_mask_viz_passes_with_flexc():
    """torch's TestBlockMask::test_block_mask_viz, on the CPU: its glyphs read as '@', spaces as 's'."""
    import string
    from torch.nn.attention import flex_attention as tfa

    def printable(text):
        return "".join("@" if c not in string.printable else ("s" if c == " " else c) for c in text)

    ours = printable(str(flexc.create_block_mask(causal, 1, 1, 2048, 2048, device="cpu")))
    theirs = printable(str(tfa.create_block_mask(causal, 1, 1, 2048, 2048, device="cpu")))
    assert ours == theirs and len(ours.splitlines()) == 19
    assert ours.splitlines()[:3] == ["BlockMask(shape=(1,s1,s2048,s2048),ssparsity=46.88%,s", "(0,s0)",
                                     "@@" + "s" * 30]


def test_to_string_with_legend_adds_the_key_to_the_glyphs_as_a_last_line():
    bm = flexc.create_block_mask(causal, None, None, 512, 384, device="cpu")
    plain, keyed = bm.to_string(), bm.to_string(legend=True)
    legend = flexc.masks.block_mask.TEXT_LEGEND
    assert legend not in plain and keyed.splitlines() == plain.rstrip().splitlines() + [legend]
    assert "\n" not in legend
    for glyph, meaning in (("██", "full (mask_mod skipped)"), ("░░", "partial or mixed (mask_mod runs)"),
                           ("blank", "empty (never visited)")):
        assert f"{glyph} {meaning}" in legend or f"{glyph}: {meaning}" in legend


def test_docs_block_mask_md_shows_what_print_block_mask_prints():
    text = open(os.path.join(ROOT, "docs", "block_mask.md"), encoding="utf-8").read()
    printed = str(flexc.create_block_mask(causal, None, None, 512, 384, device="cpu"))
    assert "\n".join(line.rstrip() for line in printed.splitlines()) in text


def test_plot_takes_the_lengths_as_q_len_and_kv_len_too_as_flexc_draw_does(tmp_path):
    upper = flexc.plot(causal, Q_LEN=96, KV_LEN=160, BLOCK_SIZE=32, path=str(tmp_path / "upper.png"), dpi=30)
    lower = flexc.plot(causal, q_len=96, kv_len=160, BLOCK_SIZE=32, path=str(tmp_path / "lower.png"), dpi=30)
    mixed = flexc.plot(causal, None, None, 96, kv_len=160, BLOCK_SIZE=32, path=str(tmp_path / "mixed.png"), dpi=30)
    for fig in (upper, lower, mixed):
        assert "96x160" in fig.axes[0].get_title()
    assert (tmp_path / "upper.png").read_bytes() == (tmp_path / "lower.png").read_bytes() \
        == (tmp_path / "mixed.png").read_bytes()


@pytest.mark.parametrize("given,words", [
    ({"Q_LEN": 64, "q_len": 64}, ["Q_LEN=64", "q_len=64"]),
    ({"KV_LEN": 64, "kv_len": 128}, ["KV_LEN=64", "kv_len=128"]),
])
def test_plot_rejects_a_length_given_in_both_spellings(given, words):
    with pytest.raises(ValueError, match="Fix: pass only one of them") as info:
        flexc.plot(causal, **given)
    assert all(word in str(info.value) for word in words)


def sliding_window_256(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 256)


def test_a_downsampled_legend_says_what_a_cell_covers_and_shows_every_full_tile():
    # 32 x 32 tiles in 16 x 16 cells: each 2 x 2 group of a 256-key window holds a full tile among partial ones
    bm = flexc.create_block_mask(sliding_window_256, None, None, 4096, 4096, device="cpu")
    plain, keyed = bm.to_string(), bm.to_string(legend=True)
    lines = keyed.splitlines()
    assert lines[-1] == flexc.masks.block_mask.cells_note(2, 2) and lines[-2] == flexc.masks.block_mask.TEXT_LEGEND
    # torch's layout is kept without the legend: ▓▓ appears only in the legend's picture, where ░░ stood
    assert "▓" not in plain and [line.replace("▓", "░") for line in lines[:-2]] == plain.rstrip().splitlines()
    fine = [line.ljust(64) for line in bm.to_string(grid_size=-1).splitlines()[1:33]]
    coarse = [line.ljust(32) for line in lines[1:17]]
    for i in range(16):
        for j in range(16):
            group = [fine[2 * i + a][4 * j + 2 * b] for a in (0, 1) for b in (0, 1)]
            expected = ("█" if set(group) == {"█"} else "▓" if "█" in group else "░" if "░" in group else " ")
            assert coarse[i][2 * j] == expected, (i, j, group)
    assert "▓▓" in keyed
    # one tile per cell: nothing to say
    assert "each cell covers" not in bm.to_string(grid_size=-1, legend=True)


def test_a_plot_title_says_when_cells_sample_the_elements(tmp_path):
    sampled = flexc.plot(causal, Q_LEN=1024, KV_LEN=512, max_pixels=256, path=str(tmp_path / "s.png"), dpi=30)
    assert "sampled: each cell shows 1 of 4 x 2 elements" in sampled.axes[0].get_title()
    whole = flexc.plot(causal, Q_LEN=96, KV_LEN=160, BLOCK_SIZE=32, path=str(tmp_path / "w.png"), dpi=30)
    assert "sampled" not in whole.axes[0].get_title()
