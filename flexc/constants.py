"""Constants defined once for the kernels, the CPU paths and the derivatives: the softmax in base 2,
and the decoding step's row limit."""

LOG2E = 1.4426950408889634  # 1 / ln(2): scores move to base 2 so the softmax can use exp2
TWO_LOG2E = 2.8853900817779268  # 2 / ln(2): e^(2x) = 2^(x * TWO_LOG2E)
LN2 = 0.6931471805599453  # a base-2 logsumexp times ln(2) is the natural one
# At most this many query rows per head make a call a decoding step: both backends' decode paths
# (flexc.backends.cpu.decode_cpu, flexc.backends.triton.decode) take it
DECODE_MAX_ROWS = 16

__all__ = ["DECODE_MAX_ROWS", "LN2", "LOG2E", "TWO_LOG2E"]
