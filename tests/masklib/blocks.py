"""Block masks with the library's defaults."""
from torch.nn.attention.flex_attention import (_DEFAULT_SPARSE_BLOCK_SIZE, BlockMask, FlexKernelOptions,
                                               _mask_mod_signature, create_block_mask)


def build_block_mask(mask_mod: _mask_mod_signature, B, H, Q_LEN: int, KV_LEN: int,
                     block_size: int = _DEFAULT_SPARSE_BLOCK_SIZE // 2) -> BlockMask:
    return create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block_size)


def default_kernel_options() -> FlexKernelOptions:
    options: FlexKernelOptions = {}
    return options
