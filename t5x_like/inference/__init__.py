"""A checkpoint's model outside training: restored onto a `data x 1 x tensor` mesh with the
config the inference tools run it with (loading.py).

Layer 6: imports layers 0-5 only.
"""
