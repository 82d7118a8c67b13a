"""Fused kernels (installed as `t5x_like.kernels`).

* `flash_attention`: causal/ALiBi/segment flash attention, forward and backward, as Pallas kernels
  (Triton lowering on GPU; `interpret=True` on CPU).
* `vocab_parallel_cross_entropy`: chunked, vocabulary-parallel softmax cross-entropy from hidden
  states and the tied embedding, never materialising tokens x vocab fp32 logits.
* `fused_cross_entropy_mean`: the same loss's mean with its gradient computed in the forward pass,
  a token chunk at a time (no recomputation in the backward pass).
* `mosaic_attention`: causal ALiBi flash attention for Hopper in Mosaic GPU (TMA, wgmma, warp
  specialisation), forward and backward; Mosaic GPU's interpret mode on CPU.
* `triton_lowering`: lowers the Pallas kernels for CUDA on any machine and verifies the Triton IR.
* `residuals`: the name under which the attention kernels mark their forward's output and
  log-sum-exp, so that the model's remat_policy='save_dots' keeps them.
* `attention_reference` (`reference.py`): the plain-JAX attention that the model's
  `attention_impl='xla'` path uses and that every kernel is tested against.
"""

from t5x_like.kernels.cross_entropy import (
  chunked_logsumexp,
  fused_cross_entropy_mean,
  vocab_parallel_cross_entropy,
)
from t5x_like.kernels.flash_attention import (
  BlockSizes,
  FlashAttentionConstraintError,
  flash_attention,
)
from t5x_like.kernels.mosaic_attention import (
  MosaicAttentionConstraintError,
  MosaicBlocks,
  mosaic_attention,
)
from t5x_like.kernels.reference import attention_reference

__all__ = [
  'BlockSizes',
  'FlashAttentionConstraintError',
  'MosaicAttentionConstraintError',
  'MosaicBlocks',
  'attention_reference',
  'chunked_logsumexp',
  'flash_attention',
  'fused_cross_entropy_mean',
  'mosaic_attention',
  'vocab_parallel_cross_entropy',
]
