"""A model outside training: a checkpoint restored onto a `data x 1 x tensor` mesh with the
config the inference tools run it with (loading.py), generation with a KV cache (decoding.py),
and the lm-evaluation-harness backend (harness_lm.py), on checkpoints or, during training, on the
live params (harness_evaluation.py).

Layer 6: imports layers 0-5 only.
"""
