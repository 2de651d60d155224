"""Model-layer building blocks as plain torch functions (no nn.Module state)."""
