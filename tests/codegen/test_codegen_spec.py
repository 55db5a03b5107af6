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
    fwd = ForwardSpec(score_mod=score, mask_mod=None, dtype=torch.float16, head_dim=64, v_head_dim=48, q_block_size=128,
                      kv_block_size=128, block_m=64, block_n=32, num_warps=4, num_stages=2, has_full_blocks=True,
                      output_lse=False, output_stats=True, target="cuda", fp32_precision="tf32", prescale_qk=True,
                      rows_guaranteed_safe=False, blocks_are_contiguous=True, index_dtype="int64", dropout=True,
                      sinks=True, tma=True, float_indices=True)
    assert fwd.key() == (("score",), None, torch.float16, 64, 48, 128, 128, 64, 32, 4, 2, True, False, True, "cuda",
                         "tf32", True, False, True, "int64", True, True, True, True)
    dec = DecodeSpec(score_mod=None, mask_mod=mask, dtype=torch.float32, head_dim=64, v_head_dim=64, kv_block_size=128,
                     block_m=16, block_n=32, num_warps=2, num_stages=2, has_full_blocks=False, target="interpreter",
                     fp32_precision="ieee", index_dtype="int32", dropout=True)
    assert dec.key() == ("decode", None, ("mask",), torch.float32, 64, 64, 128, 16, 32, 2, 2, False, "interpreter",
                         "ieee", "int32", True)
    bwd = BackwardSpec(score_mod=score, mask_mod=mask, dtype=torch.bfloat16, head_dim=64, v_head_dim=64,
                       q_block_size=128, kv_block_size=128, block_m1=32, block_n1=64, block_m2=64, block_n2=32,
                       num_warps=4, num_stages=1, has_full_blocks=True, grad_slots=(0,), target="cuda",
                       fp32_precision="ieee", index_dtype="int32", dropout=True, precise=True, float_indices=True)
    assert bwd.key() == ("backward", ("score",), ("mask",), torch.bfloat16, 64, 64, 128, 128, 32, 64, 64, 32, 4, 1,
                         True, (0,), "cuda", "ieee", "int32", True, True, True)
    merge = MergeSpec(work_dtype="float32", v_head_dim_pad=64, block_rows=16)
    assert merge.key() == ("merge", "float32", 64, 16, "cuda", 4, 1, False)
    assert dataclasses.replace(merge, sinks=True).key() == ("merge", "float32", 64, 16, "cuda", 4, 1, True)


def test_every_field_tells_keys_apart_and_captured_values_do_not():
    spec = DecodeSpec(score_mod=_Mod(("s",)), mask_mod=None, dtype=torch.float16, head_dim=64, v_head_dim=64,
                      kv_block_size=128, block_m=16, block_n=32)
    assert spec.key() == dataclasses.replace(spec, score_mod=_Mod(("s",))).key()  # same structure
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        other = _Mod(("t",)) if f.name.endswith("_mod") else not value if isinstance(value, bool) else \
            torch.float32 if f.name == "dtype" else value * 2 if isinstance(value, int) else value + "x"
        assert dataclasses.replace(spec, **{f.name: other}).key() != spec.key(), f.name


def test_a_spec_computes_its_key_once_and_stays_equal_to_a_fresh_spec():
    spec = DecodeSpec(score_mod=_Mod(("s",)), mask_mod=None, dtype=torch.float16, head_dim=64, v_head_dim=64,
                      kv_block_size=128, block_m=16, block_n=32)
    assert spec.key() is spec.key()  # (a call looks its kernels up by the key more than once)
    fresh = dataclasses.replace(spec)
    assert fresh == spec and hash(fresh) == hash(spec) and fresh.key() == spec.key()
    assert dataclasses.replace(spec, block_m=32).key() != spec.key()  # replace() does not carry the key over
