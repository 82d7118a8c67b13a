"""The device mesh: its `data x pipeline x tensor` axes and the logical axis rules that map the
model's named dimensions onto them (partitioning.py), and the processes that share it
(distributed.py).

Layer 1: imports config.py, errors.py and files.py only.
"""
