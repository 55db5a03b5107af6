"""The torch.compile integration: flex_attention as opaque custom ops inside compiled graphs."""
