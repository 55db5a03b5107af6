"""Exception types that are flexc's rule and torch's at once.

flexc raises ``TypeError``/``ValueError`` for bad inputs. For a few of the same inputs torch's
FlexAttention raises ``NotImplementedError`` or ``RuntimeError`` instead, and code written against
torch (its own test suite included) catches those. The classes below derive from both, so an
``except`` clause written for either library catches flexc's error. Their messages open with
torch's sentence for the same condition, then flexc's fix.
"""
from __future__ import annotations


class UnsupportedInputError(ValueError, NotImplementedError):
    """A value torch does not implement (e.g. 3-D or 5-D query/key/value)."""


class UnsupportedTypeError(TypeError, NotImplementedError):
    """A kind of object torch does not implement (e.g. nested tensors)."""


class InvalidValueError(ValueError, RuntimeError):
    """A value torch rejects with ``RuntimeError`` (e.g. a 1-D BlockMask table, BACKEND with
    FORCE_USE_FLEX_ATTENTION, a sliced BlockMask passed to flex_attention)."""


class AssertedValueError(ValueError, AssertionError):
    """A value torch rejects with ``AssertionError``: unpaired BlockMask tables (``full_kv_num_blocks``
    without ``full_kv_indices``), kernel_options keys torch reserves for itself (``OUTPUT_LOGSUMEXP``)."""


class InvalidTypeError(TypeError, RuntimeError):
    """A kind of object torch rejects with ``RuntimeError`` (e.g. a non-callable in and_masks)."""
