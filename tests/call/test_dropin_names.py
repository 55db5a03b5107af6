"""flexc as a drop-in: torch's commonly imported FlexAttention names exist with the same meaning,
and a library written against torch runs with only its import lines changed."""
import importlib
import inspect
import os
import re
import shutil
import sys

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import flexc
from repo import TESTS
from torch_api import OLDER_TORCH, takes

_TORCH_IMPORT = "from torch.nn.attention.flex_attention import"

# The names third-party FlexAttention code imports from torch's module.
COMMON_NAMES = ["BlockMask", "flex_attention", "create_block_mask", "create_mask", "and_masks", "or_masks",
                "noop_mask", "AuxRequest", "AuxOutput", "FlexKernelOptions", "_mask_mod_signature",
                "_score_mod_signature", "_identity", "_DEFAULT_SPARSE_BLOCK_SIZE", "_LARGE_SPARSE_BLOCK_SIZE",
                "_ModificationType", "_get_mod_type", "_vmap_for_bhqkv", "_ordered_to_dense",
                "_dense_to_ordered", "_transpose_ordered", "_round_up_to_multiple"]


def test_every_public_name_of_torch_is_in_flexc():
    missing = [name for name in torch_flex.__all__ if not hasattr(flexc, name)]
    assert missing == []


@pytest.mark.parametrize("name", COMMON_NAMES)
def test_common_name_exists(name):
    assert hasattr(torch_flex, name), f"torch no longer has {name}; update the list"
    assert hasattr(flexc, name)


def test_constants_aliases_and_enum_match_torch():
    assert flexc._DEFAULT_SPARSE_BLOCK_SIZE == torch_flex._DEFAULT_SPARSE_BLOCK_SIZE
    assert flexc._LARGE_SPARSE_BLOCK_SIZE == torch_flex._LARGE_SPARSE_BLOCK_SIZE
    assert flexc._mask_mod_signature == torch_flex._mask_mod_signature
    assert flexc._score_mod_signature == torch_flex._score_mod_signature
    assert {m.name: m.value for m in flexc._ModificationType} == {m.name: m.value for m in torch_flex._ModificationType}
    torch_keys = set(torch_flex.FlexKernelOptions.__annotations__) - {"BACKEND"}
    assert torch_keys <= set(flexc.FlexKernelOptions.__annotations__)
    assert flexc._round_up_to_multiple(130, 128) == torch_flex._round_up_to_multiple(130, 128) == 256
    assert flexc._round_up_to_multiple(128, 128) == 128


def _parameters(fn):
    """(name, kind, has a default) of each parameter a caller may pass, flexc's own private keyword-only
    extras (``_analytic``) left out."""
    fn = getattr(fn, "__func__", fn)
    return [(p.name, p.kind, p.default is not p.empty) for p in inspect.signature(fn).parameters.values()
            if not (p.kind == p.KEYWORD_ONLY and p.name.startswith("_") and p.default is not p.empty)]


def _shared_callables():
    """Every function, and every method of a class, that torch's module and flexc both define."""
    for name in sorted(n for n in dir(torch_flex) if not n.startswith("__") and hasattr(flexc, n)):
        ours, theirs = getattr(flexc, name), getattr(torch_flex, name)
        if ours is theirs or not callable(theirs) or getattr(theirs, "__module__", "").startswith("typing"):
            continue
        if isinstance(theirs, type):
            for attr, value in vars(theirs).items():
                if (callable(getattr(value, "__func__", value)) and hasattr(ours, attr)
                        and (not attr.startswith("__") or attr == "__init__")):
                    yield f"{name}.{attr}", inspect.getattr_static(ours, attr), value
        elif inspect.isfunction(theirs):
            yield name, ours, theirs


_SHARED = list(_shared_callables())


@pytest.mark.parametrize("name,ours,theirs", _SHARED, ids=[name for name, _, _ in _SHARED])
def test_shared_functions_and_methods_take_torchs_parameter_names(name, ours, theirs):
    """Code that passes arguments by name (noop_mask(batch=..., token_q=...)) works unchanged. flexc's
    own extensions of flex_attention (sinks, dropout_p, generator) come after torch's parameters, are
    keyword-only and have defaults, so torch's calls are unaffected."""
    mine, torchs = _parameters(ours), _parameters(theirs)
    extra = _OWN_KEYWORDS.get(name, ())
    core, added = [p for p in mine if p[0] not in extra], [p for p in mine if p[0] in extra]
    # torch's parameters, by name and kind, each default torch has also flexc's (flexc may default one
    # torch requires: _ordered_to_dense's num_cols, which torch 2.11 read from the table)
    assert [p[:2] for p in core[:len(torchs)]] == [p[:2] for p in torchs], name
    assert all(ours_default for (_, _, ours_default), (_, _, default) in zip(core, torchs) if default), name
    if OLDER_TORCH:  # then the parameters a later torch added (flexc follows it), each with a default
        assert all(default for _, _, default in core[len(torchs):]), name
    else:
        assert len(core) == len(torchs), name
    assert mine[len(mine) - len(added):] == added, name
    assert all(kind == inspect.Parameter.KEYWORD_ONLY for _, kind, _ in added), name


# flexc's own keyword-only extensions (docs/differences.md)
_OWN_KEYWORDS = {"flex_attention": ("sinks", "dropout_p", "generator"), "BlockMask.to_string": ("legend",)}


def test_noop_mask_takes_torchs_keywords():
    b = h = q = kv = torch.tensor(0)
    assert flexc.noop_mask(batch=b, head=h, token_q=q, token_kv=kv) == torch_flex.noop_mask(
        batch=b, head=h, token_q=q, token_kv=kv)
    assert str(flexc.trace(flexc.noop_mask)) == "True"


def test_get_mod_type_and_identity():
    def mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def mod(score, b, h, q_idx, kv_idx, extra=1.0):
        return score * extra

    for fn in (mask, mod, flexc._identity):
        assert flexc._get_mod_type(fn).name == torch_flex._get_mod_type(fn).name
    with pytest.raises(TypeError, match="positional"):
        flexc._get_mod_type(lambda a, b: a)
    s = torch.randn(3)
    assert flexc._identity(s, 0, 0, 0, 0) is s
    assert str(flexc.trace(flexc._identity)) == "score"


def test_vmap_for_bhqkv_matches_torch():
    def mod(score, b, h, q_idx, kv_idx):
        return score * (h + 1) + (q_idx - kv_idx) * 0.5

    def mask(b, h, q_idx, kv_idx):
        return (q_idx + b) % 3 <= kv_idx % 4

    b, h, q, kv = torch.arange(2), torch.arange(3), torch.arange(5), torch.arange(7)
    scores = torch.randn(2, 3, 5, 7)
    ours = flexc._vmap_for_bhqkv(mod, prefix=(0,))(scores, b, h, q, kv)
    assert torch.equal(ours, torch_flex._vmap_for_bhqkv(mod, prefix=(0,))(scores, b, h, q, kv))
    assert torch.equal(flexc._vmap_for_bhqkv(mask, prefix=())(b, h, q, kv),
                       torch_flex._vmap_for_bhqkv(mask, prefix=())(b, h, q, kv))


def test_vmap_for_bhqkv_group_dim_matches_torch():
    def mask(b, h, q_idx, kv_idx):
        return (h * 2 + q_idx) % 5 >= kv_idx % 3

    args = (torch.arange(2), torch.arange(3), torch.arange(4), torch.arange(6))
    ours = flexc._vmap_for_bhqkv(mask, prefix=(), group_dim=True)
    theirs = torch_flex._vmap_for_bhqkv(mask, prefix=(), group_dim=True)
    h2 = torch.arange(6).view(3, 2)  # the [hkv, g] head grid
    assert torch.equal(ours(args[0], h2, args[2], args[3]), theirs(args[0], h2, args[2], args[3]))


def test_block_table_converters_match_torch():
    g = torch.Generator().manual_seed(0)
    dense = (torch.rand(2, 3, 5, 6, generator=g) < 0.4).to(torch.int32)
    ours, theirs = flexc._dense_to_ordered(dense), torch_flex._dense_to_ordered(dense)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours, theirs))
    width = (6,) if takes(torch_flex._ordered_to_dense, "num_cols") else ()  # (torch 2.11: the table's width)
    assert torch.equal(flexc._ordered_to_dense(*ours, 6), torch_flex._ordered_to_dense(*theirs, *width))
    assert torch.equal(flexc._ordered_to_dense(*ours), flexc._ordered_to_dense(*ours, 6))  # 2.11's two-argument form
    square = dense[..., :5]
    pair = torch_flex._dense_to_ordered(square)
    assert all(torch.equal(a, b) for a, b in zip(flexc._transpose_ordered(*pair), torch_flex._transpose_ordered(*pair)))


def test_create_nested_block_mask_is_document_masking_over_packed_sequences():
    lengths = [5, 9, 3]
    nt = torch.nested.nested_tensor([torch.randn(n, 2, 4) for n in lengths], layout=torch.jagged)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    bm = flexc.create_nested_block_mask(causal, 3, 2, nt, BLOCK_SIZE=4)
    total = sum(lengths)
    assert bm.shape == (1, 2, total, total)
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    start = torch.tensor([0, 5, 14])
    i = torch.arange(total)
    expected = (doc[:, None] == doc[None, :]) & ((i - start[doc])[:, None] >= (i - start[doc])[None, :])
    dense = flexc.create_mask(bm.mask_mod, 1, 2, total, total)
    assert torch.equal(dense[0, 1], expected)
    with pytest.raises(ValueError, match="jagged"):
        flexc.create_nested_block_mask(causal, 1, 1, torch.randn(2, 5, 2, 4))


# ---- the library, copied with its import lines changed -------------------------------------

@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """(torch's masklib, the same files importing flexc)."""
    source = str(TESTS / "masklib")
    root = tmp_path_factory.mktemp("swapped")
    target = root / "masklib_flexc"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    changed = 0
    for path in target.glob("*.py"):
        text = path.read_text()
        new = text.replace(_TORCH_IMPORT, "from flexc import")
        changed += text != new
        assert "torch.nn.attention.flex_attention" not in new
        path.write_text(new)
    assert changed == 5  # every module but __init__ imports torch's FlexAttention names
    sys.path.insert(0, str(root))
    try:
        swapped = importlib.import_module("masklib_flexc")
    finally:
        sys.path.remove(str(root))
    original = importlib.import_module("masklib")
    assert re.search(r"^from flexc import", (target / "utils.py").read_text(), re.M)
    return original, swapped


def _masks(lib, L):
    offsets = torch.tensor([0, 37, 100, L])
    return {
        "causal": lib.causal_mask,
        "sliding": lib.generate_sliding_window(24),
        "prefix_lm": lib.generate_prefix_lm_mask(40),
        "documents": lib.generate_doc_mask_mod(lib.causal_mask, offsets),
    }


@pytest.mark.parametrize("name", ["causal", "sliding", "prefix_lm", "documents"])
def test_swapped_library_builds_the_same_block_masks(libraries, name):
    original, swapped = libraries
    L = 160
    ref = original.build_block_mask(_masks(original, L)[name], 2, 1, L, L)
    ours = swapped.build_block_mask(_masks(swapped, L)[name], 2, 1, L, L)
    assert isinstance(ours, flexc.BlockMask)
    assert ours.BLOCK_SIZE == ref.BLOCK_SIZE
    for table in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(ours.to_dense() if table == "kv_indices" else getattr(ours, table),
                           ref.to_dense() if table == "kv_indices" else getattr(ref, table)), table


@pytest.mark.parametrize("name", ["causal", "documents"])
def test_swapped_library_grids_match(libraries, name):
    original, swapped = libraries
    L = 130
    assert torch.equal(swapped.mod_grid(_masks(swapped, L)[name], 1, 2, L, L),
                       original.mod_grid(_masks(original, L)[name], 1, 2, L, L))
    scores = torch.randn(1, 4, 9, 11)
    assert torch.equal(swapped.mod_grid(swapped.generate_alibi_bias(4), 1, 4, 9, 11, scores),
                       original.mod_grid(original.generate_alibi_bias(4), 1, 4, 9, 11, scores))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name,mods", [("sliding", ("alibi",)), ("documents", ("alibi", "softcap")),
                                       ("prefix_lm", ())])
def test_swapped_library_attends_like_torch(libraries, name, mods):
    original, swapped = libraries
    L = 160
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, L, 16, generator=g) for _ in range(3))

    def run(lib):
        factories = {"alibi": lambda: lib.generate_alibi_bias(4), "softcap": lambda: lib.generate_tanh_softcap(5.0)}
        return lib.attend(q, k, v, _masks(lib, L)[name], *(factories[m]() for m in mods))

    out, lse = run(swapped)
    ref_out, ref_lse = run(original)
    assert out.dtype == ref_out.dtype and lse.dtype == ref_lse.dtype
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


# ---- sys.modules["torch.nn.attention.flex_attention"] = flexc --------------------------------

_MODULE = "torch.nn.attention.flex_attention"


def _names_torch_takes_from_its_flex_attention_module():
    """Every name torch's own sources import from the module path, or read as an attribute of it."""
    import ast

    root = os.path.dirname(torch.__file__)
    names = {}
    for directory, _, files in os.walk(root):
        for file in files:
            path = os.path.join(directory, file)
            if not file.endswith(".py") or path == torch_flex.__file__:
                continue
            with open(path, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
            if _MODULE not in text:
                continue
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == _MODULE:
                    names.update((alias.name, os.path.relpath(path, root)) for alias in node.names)
                elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == _MODULE:
                    names[node.attr] = os.path.relpath(path, root)
    return names


def test_every_name_torch_itself_imports_from_the_flex_attention_module_is_in_flexc():
    names = _names_torch_takes_from_its_flex_attention_module()
    # torch's compiler (dynamo's user_defined.py) and its kernels import these; the list is not empty
    assert {"_MaskModWrapper", "_vmap_for_bhqkv", "BlockMask", "noop_mask"} <= set(names)
    missing = {name: where for name, where in names.items() if not hasattr(flexc, name)}
    assert missing == {}, "torch imports these from torch.nn.attention.flex_attention; flexc lacks them"
    assert flexc._MaskModWrapper is torch_flex._MaskModWrapper  # dynamo checks isinstance against torch's


def test_swapping_flexc_in_for_torchs_module_keeps_compiled_calls_working(monkeypatch):
    """The literal swap (as in transformers): torch's compiler imports _MaskModWrapper and friends
    from the module path while compiling, so they come from flexc."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    expected = flexc.flex_attention(q, k, v, block_mask=flexc.create_block_mask(causal, None, None, 64, 64,
                                                                                device="cpu", BLOCK_SIZE=32))
    torch._dynamo.reset()
    monkeypatch.setitem(sys.modules, _MODULE, flexc)  # restored when the test ends
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        assert importlib.import_module(_MODULE) is flexc and flex_attention is flexc.flex_attention

        def attend(q, k, v, block_mask):
            return flex_attention(q, k, v, block_mask=block_mask)

        block_mask = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
        out = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v, block_mask)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, expected)
