"""Block masks: BlockMask, create_block_mask, the mask combinators, table lists and their pytree registration."""
