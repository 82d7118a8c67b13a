"""The optimizers: optax AdamW over fp32 master weights (adamw.py) and bitsandbytes-style
block-wise 8-bit Adam (quantized_adam.py).

Layer 2: imports layers 0-1 (config, errors, mesh) only.
"""
