"""examples/gallery.py runs, draws every entry, and writes exactly the committed docs/gallery.md and its pictures."""
import os
import re
import subprocess
import sys

import pytest
from repo import ROOT



def test_gallery_script_runs_and_docs_gallery_md_is_up_to_date(tmp_path):
    pytest.importorskip("matplotlib")
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "gallery.py"), "--out", str(tmp_path), "--dpi", "20"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    written = (tmp_path / "gallery.md").read_text()
    assert written == (ROOT / "docs" / "gallery.md").read_text(), \
        "docs/gallery.md is stale: run `python examples/gallery.py` and commit docs/gallery.md"
    pictures = re.findall(r"!\[[^]]*\]\((gallery/[^)]+\.png)\)", written)
    # attention-gym's catalogue, at least
    for name in ("sliding_window", "prefix_lm", "document_causal", "dilated_sliding_window", "natten_1d", "natten_2d",
                 "global_tokens", "sliding_tile_attention", "soft_capping", "alibi", "t5_relative_buckets",
                 "learned_relative_bias"):
        assert f"gallery/{name}.png" in pictures, name
    for picture in pictures:
        assert (tmp_path / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", picture


def test_every_picture_docs_gallery_md_links_is_committed():
    """A fresh clone shows the gallery: each linked PNG exists, is a PNG, is small and is tracked by git."""
    text = (ROOT / "docs" / "gallery.md").read_text()
    pictures = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert len(pictures) >= 12
    for picture in pictures:
        path = ROOT / "docs" / picture
        assert path.is_file(), f"docs/gallery.md links {picture}, missing: run `python examples/gallery.py`"
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", picture
        assert len(data) < 60_000, f"{picture} is {len(data)} bytes: draw it at a lower --dpi"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: tracked-ness cannot be checked")
    listed = subprocess.run(["git", "ls-files", "--", *(f"docs/{p}" for p in pictures)], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    missing = sorted(set(f"docs/{p}" for p in pictures) - set(listed))
    assert not missing, f"not tracked by git (check .gitignore's !docs/gallery/*.png): {missing}"
