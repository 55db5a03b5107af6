"""The kernel specs' cache keys, derived from their fields (flexc.codegen.spec)."""
import dataclasses

import torch

from flexc.codegen.backward import BackwardSpec
from flexc.codegen.decode import DecodeSpec
from flexc.codegen.forward import ForwardSpec
from flexc.codegen.merge import MergeSpec


class _Mod:
    """Stands in for a TracedMod: the key holds its structure key, never the object."""

    def __init__(self, key):
        self.key = key


def test_the_key_is_the_kind_then_every_field_in_order_with_mods_by_structure():
    score, mask = _Mod(("score",)), _Mod(("mask",))
    fwd = ForwardSpec(score, None, torch.float16, 64, 48, 128, 128, 64, 32, 4, 2, True, False, True, "cuda", "tf32",
                      True, False, True, "int64", True, True, True, True)
    assert fwd.key() == (("score",), None, torch.float16, 64, 48, 128, 128, 64, 32, 4, 2, True, False, True, "cuda",
                         "tf32", True, False, True, "int64", True, True, True, True)
    dec = DecodeSpec(None, mask, torch.float32, 64, 64, 128, 16, 32, 2, 2, False, "interpreter", "ieee", "int32", True)
    assert dec.key() == ("decode", None, ("mask",), torch.float32, 64, 64, 128, 16, 32, 2, 2, False, "interpreter",
                         "ieee", "int32", True)
    bwd = BackwardSpec(score, mask, torch.bfloat16, 64, 64, 128, 128, 32, 64, 64, 32, 4, 1, True, (0,), "cuda",
                       "ieee", "int32", True, True, True)
    assert bwd.key() == ("backward", ("score",), ("mask",), torch.bfloat16, 64, 64, 128, 128, 32, 64, 64, 32, 4, 1,
                         True, (0,), "cuda", "ieee", "int32", True, True, True)
    assert MergeSpec("float32", 64, 16).key() == ("merge", "float32", 64, 16, "cuda", 4, 1, False)
    assert MergeSpec("float32", 64, 16, sinks=True).key() == ("merge", "float32", 64, 16, "cuda", 4, 1, True)


def test_every_field_tells_keys_apart_and_captured_values_do_not():
    spec = DecodeSpec(_Mod(("s",)), None, torch.float16, 64, 64, 128, 16, 32)
    assert spec.key() == dataclasses.replace(spec, score_mod=_Mod(("s",))).key()  # same structure
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        other = _Mod(("t",)) if f.name.endswith("_mod") else not value if isinstance(value, bool) else \
            torch.float32 if f.name == "dtype" else value * 2 if isinstance(value, int) else value + "x"
        assert dataclasses.replace(spec, **{f.name: other}).key() != spec.key(), f.name


def test_a_spec_computes_its_key_once_and_stays_equal_to_a_fresh_spec():
    spec = DecodeSpec(_Mod(("s",)), None, torch.float16, 64, 64, 128, 16, 32)
    assert spec.key() is spec.key()  # (a call looks its kernels up by the key more than once)
    fresh = dataclasses.replace(spec)
    assert fresh == spec and hash(fresh) == hash(spec) and fresh.key() == spec.key()
    assert dataclasses.replace(spec, block_m=32).key() != spec.key()  # replace() does not carry the key over
