"""docs/differences.md names every torch FlexAttention name that flexc does not provide."""
import re
import types

from torch.nn.attention import flex_attention as tfa

import flexc
from repo import ROOT

DOC = (ROOT / "docs" / "differences.md").read_text()


def _listed(name: str) -> bool:
    return re.search(rf"`{re.escape(name)}`", DOC) is not None


def test_every_torch_name_is_provided_or_listed_as_missing():
    # names torch's module defines itself (not the typing helpers and modules it imports)
    own = [name for name, value in vars(tfa).items()
           if not name.startswith("__") and not isinstance(value, types.ModuleType)
           and getattr(value, "__module__", tfa.__name__) == tfa.__name__]
    assert "flex_attention" in own and "BlockMask" in own
    unlisted = [name for name in own if not hasattr(flexc, name) and not _listed(name)]
    assert unlisted == [], "add these to docs/differences.md (or provide them)"
    block_mask = [name for name in dir(tfa.BlockMask)
                  if not name.startswith("__") and not hasattr(flexc.BlockMask, name) and not _listed(name)]
    assert block_mask == [], "add these BlockMask members to docs/differences.md (or provide them)"


def test_every_public_torch_name_is_provided():
    assert [name for name in tfa.__all__ if not hasattr(flexc, name)] == []
