"""The header comment every generated kernel opens with: its mods, dtypes and head dims, and notes."""
from __future__ import annotations

from ..mods.trace import TracedMod
from .spec import AttentionSpec, padded_head_dim


def describe_mod(traced: TracedMod | None, what: str) -> str:
    """The line naming a mod and its expression."""
    if traced is None:
        return f"#   {what:<9} none"
    name = traced.name if traced.name != "<lambda>" else "lambda"
    return f"#   {what:<9} {name}: {traced}"


def describe_mods(spec: AttentionSpec) -> list[str]:
    return [describe_mod(spec.score_mod, "score_mod"), describe_mod(spec.mask_mod, "mask_mod")]


def describe_dims(spec: AttentionSpec) -> str:
    """The line giving the dtype and the head dims with their padding."""
    E, Ev = spec.head_dim, spec.v_head_dim
    return (f"#   dtype {str(spec.dtype).removeprefix('torch.')}; head dim {E} (padded to {padded_head_dim(E)}), "
            f"value head dim {Ev} (padded to {padded_head_dim(Ev)})")


def index_note(spec: AttentionSpec) -> list[str]:
    """A line naming the mods' index arithmetic where it is not int32."""
    return [f"#   index arithmetic in the mods: {spec.index_dtype}"] if spec.index_dtype != "int32" else []


def widen_note(spec: AttentionSpec, why: str = "products of 16-bit values are exact in fp32, so results agree."
               ) -> list[str]:
    """Where the interpreter widens 16-bit tiles (:attr:`AttentionSpec.widens`), the lines saying so and why
    results still agree."""
    if not spec.widens:
        return []
    return ["# Under Triton's CPU interpreter 16-bit tiles are widened to fp32 before tl.dot (its 16-bit",
            f"# dot is unreliable); {why}"]


__all__ = ["describe_dims", "describe_mod", "describe_mods", "index_note", "widen_note"]
