"""Draw every mask and score_mod of the catalogue below and write docs/gallery.md.

    python examples/gallery.py                 # docs/gallery.md and docs/gallery/*.png
    python examples/gallery.py --out DIR       # somewhere else (DIR/gallery.md, DIR/gallery/*.png)

The catalogue covers attention-gym's masks and score_mods and a few more. Each picture is
flexc.plot's: full tiles (the kernel skips the mask_mod), partial tiles (it runs the mask_mod;
allowed and masked elements in two colours) and empty tiles (never visited). score_mods are heat
maps of what they add to a zero score (or of what they make of a ramp of scores), blank where
their mask masks. The Markdown holds each mod's source and its sparsity.
"""
from __future__ import annotations

import argparse
import inspect
import math
import pathlib
import textwrap

import torch

import flexc

SEQ = 512        # sequence length of the 1-D examples
IMAGE = 24       # the 2-D examples: an IMAGE x IMAGE grid of tokens, row-major (576 tokens)
TILE = 8         # STA: tokens ordered tile by tile, TILE x TILE per tile
HEADS = 8


# ---- masks ------------------------------------------------------------------------------------

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


WINDOW = 128


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


PREFIX = 160


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


# Several documents packed into one sequence; each attends causally within itself.
document_id = torch.repeat_interleave(torch.arange(5), torch.tensor([150, 60, 170, 90, 42]))


def document_causal(b, h, q_idx, kv_idx):
    return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)


DILATION = 4


def dilated_sliding_window(b, h, q_idx, kv_idx):
    distance = q_idx - kv_idx
    return (distance >= 0) & (distance <= WINDOW) & (distance % DILATION == 0)


CHUNK = 128


def chunked_causal(b, h, q_idx, kv_idx):
    return (q_idx // CHUNK == kv_idx // CHUNK) & (q_idx >= kv_idx)


GLOBAL = 16  # the first GLOBAL tokens see and are seen by everything


def global_tokens(b, h, q_idx, kv_idx):
    return (q_idx < GLOBAL) | (kv_idx < GLOBAL) | ((q_idx - kv_idx).abs() <= 32)


KERNEL = 65  # NATTEN 1-D: each query sees KERNEL neighbours, the window shifted inward at the edges


def natten_1d(b, h, q_idx, kv_idx):
    center = torch.clamp(q_idx, KERNEL // 2, SEQ - 1 - KERNEL // 2)
    return (center - kv_idx).abs() <= KERNEL // 2


KERNEL_2D = 7  # NATTEN 2-D: a KERNEL_2D x KERNEL_2D neighbourhood in the image, clamped at the borders


def natten_2d(b, h, q_idx, kv_idx):
    half = KERNEL_2D // 2
    q_row, q_col = q_idx // IMAGE, q_idx % IMAGE
    kv_row, kv_col = kv_idx // IMAGE, kv_idx % IMAGE
    center_row = torch.clamp(q_row, half, IMAGE - 1 - half)
    center_col = torch.clamp(q_col, half, IMAGE - 1 - half)
    return ((center_row - kv_row).abs() <= half) & ((center_col - kv_col).abs() <= half)


def sliding_tile_attention(b, h, q_idx, kv_idx):
    # STA: tokens stored tile by tile; a query's tile attends to the 3 x 3 tiles around it.
    tiles_per_row = IMAGE // TILE
    q_tile, kv_tile = q_idx // (TILE * TILE), kv_idx // (TILE * TILE)
    q_tile_row, q_tile_col = q_tile // tiles_per_row, q_tile % tiles_per_row
    kv_tile_row, kv_tile_col = kv_tile // tiles_per_row, kv_tile % tiles_per_row
    return ((q_tile_row - kv_tile_row).abs() <= 1) & ((q_tile_col - kv_tile_col).abs() <= 1)


# Cross-attention from text to images (Flamingo-style): each text token sees the latest image before it.
text_image = torch.div(torch.arange(SEQ), 128, rounding_mode="floor")  # image shown before each text token
IMAGE_TOKENS = 64  # keys: 4 images of 64 tokens each


def cross_attention_to_latest_image(b, h, q_idx, kv_idx):
    return text_image[q_idx] == kv_idx // IMAGE_TOKENS


# ---- score_mods -------------------------------------------------------------------------------

alibi_slopes = torch.exp2(-8.0 * torch.arange(1, HEADS + 1) / HEADS)


def alibi(score, b, h, q_idx, kv_idx):
    return score + alibi_slopes[h] * (kv_idx - q_idx)


SOFT_CAP = 30.0


def soft_capping(score, b, h, q_idx, kv_idx):
    return SOFT_CAP * torch.tanh(score / SOFT_CAP)


NUM_BUCKETS, MAX_DISTANCE = 32, 128
t5_table = torch.randn(HEADS, NUM_BUCKETS, generator=torch.Generator().manual_seed(0))


def t5_relative_buckets(score, b, h, q_idx, kv_idx):
    # T5's bidirectional buckets: exact for small distances, logarithmic up to MAX_DISTANCE.
    relative = kv_idx - q_idx
    half = NUM_BUCKETS // 2
    exact = half // 2
    distance = relative.abs()
    log_bucket = exact + (torch.log(torch.clamp(distance, min=1).float() / exact)
                          / math.log(MAX_DISTANCE / exact) * (half - exact)).long()
    bucket = (relative > 0).long() * half + torch.where(distance < exact, distance,
                                                        torch.clamp(log_bucket, max=half - 1))
    return score + t5_table[h, bucket]


learned_bias = torch.randn(2 * SEQ - 1, generator=torch.Generator().manual_seed(1)).cumsum(0) / 8


def learned_relative_bias(score, b, h, q_idx, kv_idx):
    # a learned table indexed by the relative position (a smooth random walk here)
    return score + learned_bias[q_idx - kv_idx + SEQ - 1]


# ---- the catalogue ----------------------------------------------------------------------------

# (name, target, mask_mod, plot keywords, caption)
CATALOGUE = [
    ("causal", causal, None, {}, "Causal attention: each query sees itself and the past."),
    ("sliding_window", sliding_window, None, {}, f"Causal sliding window of {WINDOW} tokens."),
    ("prefix_lm", prefix_lm, None, {}, f"Prefix-LM: bidirectional over the first {PREFIX} tokens, causal after."),
    ("document_causal", document_causal, None, {},
     "Documents packed into one sequence (a captured document-id tensor), causal within each."),
    ("dilated_sliding_window", dilated_sliding_window, None, {},
     f"Dilated sliding window: every {DILATION}th key within {WINDOW}: every tile is partial."),
    ("chunked_causal", chunked_causal, None, {}, f"Chunked causal: causal inside chunks of {CHUNK} tokens."),
    ("global_tokens", global_tokens, None, {"BLOCK_SIZE": 64},
     f"Global tokens: the first {GLOBAL} tokens attend and are attended everywhere; a window of 32 elsewhere."),
    ("natten_1d", natten_1d, None, {"BLOCK_SIZE": 64}, f"NATTEN 1-D: a neighbourhood of {KERNEL} keys, "
     "shifted inward at the edges so every query sees the same number."),
    ("natten_2d", natten_2d, None, {"Q_LEN": IMAGE * IMAGE, "BLOCK_SIZE": 64},
     f"NATTEN 2-D: a {KERNEL_2D}x{KERNEL_2D} neighbourhood in a {IMAGE}x{IMAGE} image (row-major tokens)."),
    ("sliding_tile_attention", sliding_tile_attention, None, {"Q_LEN": IMAGE * IMAGE, "BLOCK_SIZE": 64},
     f"Sliding tile attention (STA): tokens stored in {TILE}x{TILE} tiles; each tile sees the 3x3 tiles "
     f"around it. Tiles of 64 tokens line up with the BlockMask: no partial tiles."),
    ("cross_attention_to_latest_image", cross_attention_to_latest_image, None,
     {"KV_LEN": 4 * IMAGE_TOKENS, "BLOCK_SIZE": 64},
     "Cross-attention (Flamingo-style): text tokens see the tokens of the latest image only."),
    ("alibi", alibi, causal, {"H": HEADS, "head": 0},
     "ALiBi: a per-head linear distance penalty (head 0, the steepest), causal."),
    ("soft_capping", soft_capping, None, {"score": torch.linspace(-100.0, 100.0, SEQ)},
     f"Soft-capping (Gemma 2, Grok): scores squashed into (-{SOFT_CAP:g}, {SOFT_CAP:g}); drawn on a ramp of "
     "scores from -100 to 100 along kv_idx."),
    ("t5_relative_buckets", t5_relative_buckets, None, {"H": HEADS, "head": 1},
     f"T5 relative-position buckets ({NUM_BUCKETS} buckets up to distance {MAX_DISTANCE}), a learned "
     "table per head (head 1)."),
    ("learned_relative_bias", learned_relative_bias, sliding_window, {},
     "A learned bias indexed by relative position (a captured table), under the sliding window."),
]


def _source(*fns) -> str:
    return "\n\n".join(textwrap.dedent(inspect.getsource(fn)).strip() for fn in fns if fn is not None)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "docs"),
                        help="folder for gallery.md and gallery/*.png (docs/)")
    parser.add_argument("--dpi", type=int, default=64, help="resolution of the pictures (64: each PNG stays under 40 KB)")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    (out / "gallery").mkdir(parents=True, exist_ok=True)
    lines = ["# Gallery", "",
             "Every mask and score_mod of `examples/gallery.py`, drawn by `flexc.plot`. The pictures are "
             "generated (`python examples/gallery.py` writes them to `docs/gallery/`); this page is checked "
             "against the script by `tests/tools/test_gallery.py`.", "",
             "Colours: **blue** full tiles (the kernel skips the mask_mod), **orange** partial tiles (the "
             "kernel runs the mask_mod; light orange marks the elements it masks), **grey** empty tiles "
             "(never visited). Tiles are 128x128 unless stated.", ""]
    for name, target, mask_mod, options, caption in CATALOGUE:
        options = dict(options)
        q_len = options.pop("Q_LEN", SEQ)
        kv_len = options.pop("KV_LEN", q_len)
        heads = options.pop("H", None)
        block = options.get("BLOCK_SIZE", 128)
        flexc.plot(target, None, heads, q_len, kv_len, mask_mod=mask_mod, path=str(out / "gallery" / f"{name}.png"),
                   dpi=args.dpi, **options)
        mask = target if _is_mask(target) else mask_mod
        if mask is None:
            shape = f"{q_len} x {kv_len} tokens, no mask."
        else:
            block_mask = flexc.create_block_mask(mask, None, heads, q_len, kv_len, device="cpu", BLOCK_SIZE=block)
            shape = (f"{q_len} x {kv_len} tokens, tiles {block}x{block}, sparsity {block_mask.sparsity():.1f}% "
                     f"(the share of the matrix never computed).")
        lines += [f"## {name}", "", caption, "", shape, "",
                  f"![{name}](gallery/{name}.png)", "", "```python", _source(target, mask_mod), "```", ""]
    (out / "gallery.md").write_text("\n".join(lines))
    print(f"wrote {out / 'gallery.md'} and {len(CATALOGUE)} pictures in {out / 'gallery'}")


def _is_mask(fn) -> bool:
    return len(inspect.signature(fn).parameters) == 4


if __name__ == "__main__":
    main()
