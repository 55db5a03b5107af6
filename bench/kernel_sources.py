"""Write the generated kernel source of every catalogue case to a folder, or compare with such a folder.

A restructuring of the package must not change a single byte of what runs. This script renders,
for every mask of the test catalogue and a spread of score_mods, the kernels ``flexc.kernel_source``
returns for inference, training (the forward with the logsumexp), the backward, and decoding
(at most 16 query rows), both as Triton's interpreter runs them on a CPU and as a simulated sm_90
GPU compiles them. Nothing is compiled or launched.

    python bench/kernel_sources.py --out /tmp/before       # on the old revision
    python bench/kernel_sources.py --compare /tmp/before   # on the new one: exit 1 on any difference
"""
from __future__ import annotations

import argparse
import hashlib
import pathlib
import sys
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's flexc (not an installed one) and its catalogue

import flexc  # noqa: E402
from flexc.device import simulate  # noqa: E402
from catalogue import mask_catalogue, score_catalogue  # noqa: E402

B, H, L, D = 1, 2, 256, 64
SCORES = ("alibi_captured_slopes", "relative_position", "soft_capping_tanh", "per_head_bias", "sigmoid_gate")


def _cases():
    masks = mask_catalogue(B, H, L, L)
    scores = score_catalogue(B, H, L, L)
    chosen = {"none": None, **{name: fn for name, fn in scores.items() if name in SCORES}}
    assert len(chosen) == len(SCORES) + 1, "a score_mod named in SCORES left the catalogue"
    for mask_name, mask in masks.items():
        for score_name, score in chosen.items():
            yield f"{mask_name}__{score_name}", mask, score


def _sources(mask, score):
    """(variant name, source) for every kernel kind of one case."""
    block_mask = flexc.create_block_mask(mask, B, H, L, L, device="cpu")
    options = {"BACKEND": "TRITON"}
    for device in ("interpreter", "sm_90"):
        with simulate(None if device == "interpreter" else device):
            q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
            yield f"{device}.inference", flexc.kernel_source(q, k, v, score, block_mask, kernel_options=options)
            trained = [t.requires_grad_() for t in (q, k, v)]
            yield f"{device}.training", flexc.kernel_source(*trained, score, block_mask, kernel_options=options)
            yield f"{device}.backward", flexc.kernel_source(*trained, score, block_mask, kernel_options=options,
                                                            backward=True)
            rows = torch.randn(B, H, 8, D)
            decode_mask = flexc.create_block_mask(mask, B, H, 8, L, device="cpu")
            yield f"{device}.decode", flexc.kernel_source(rows, k.detach(), v.detach(), score, decode_mask,
                                                          kernel_options=options)


def render() -> dict[str, str]:
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, mask, score in _cases():
            for variant, source in _sources(mask, score):
                out[f"{name}.{variant}.py"] = source
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=pathlib.Path, help="folder to write the sources into")
    group.add_argument("--compare", type=pathlib.Path, help="folder written by --out to compare with")
    args = parser.parse_args(argv)
    sources = render()
    digest = hashlib.sha256("".join(k + v for k, v in sorted(sources.items())).encode()).hexdigest()[:16]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, text in sources.items():
            (args.out / name).write_text(text)
        print(f"{len(sources)} kernel sources written to {args.out} (digest {digest})")
        return 0
    before = {p.name: p.read_text() for p in args.compare.glob("*.py")}
    changed = sorted(n for n in sources if before.get(n) != sources[n])
    missing = sorted(set(before) - set(sources))
    for name in changed + missing:
        print(f"differs: {name}")
    print(f"{len(sources)} kernel sources, {len(changed)} differ, {len(missing)} missing (digest {digest})")
    return 1 if changed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
