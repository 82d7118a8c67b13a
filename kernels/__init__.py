"""Fused GPU kernels (installed as `t5x_like.kernels`).

`reference.py` holds the plain-JAX attention that the model's `attention_impl='xla'` path uses and
that every future kernel is tested against.
"""

from t5x_like.kernels.reference import attention_reference

__all__ = ['attention_reference']
