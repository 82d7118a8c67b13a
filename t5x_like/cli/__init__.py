"""The command-line tools, one module per command (`python -m t5x_like.<command>` and the
`t5x-like-*` console scripts run them): train, evaluate, generate, harness, ckpt, data, plan, plot,
watch, devices, from_megatron.

Layer 7: may import any layer; nothing imports it.
"""
