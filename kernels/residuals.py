"""The names under which the fused kernels mark their forward's residuals.

A kernel's backward needs its forward's output and log-sum-exp. Under a `jax.checkpoint` policy
that does not save them, the backward pass runs the whole forward kernel again to get them:
`dots_with_no_batch_dims_saveable` saves matmul outputs, and a kernel is no matmul. Marked with
`jax.ad_checkpoint.checkpoint_name(x, ATTENTION_RESIDUALS)`, they can be saved by name
(`jax.checkpoint_policies.save_only_these_names`): the model's `remat_policy='save_dots'` does.
They are small beside what they spare: [batch, seq, heads, head_dim] and a float32
[batch, heads, seq] per layer.

The chunked cross-entropy marks its log-sum-exp, a float32 [tokens], with LOSS_RESIDUALS: the
pipeline recomputes the head in its backward pass (it keeps only the head's input per tick),
and with the log-sum-exp saved that recomputation stops before the loss's vocabulary loop
instead of running it (every logits tile, its matmul and its reductions) a second time.
"""

from jax.ad_checkpoint import checkpoint_name

ATTENTION_RESIDUALS = 'attention_residuals'
LOSS_RESIDUALS = 'loss_residuals'


def mark_residuals(out, lse):
  """`out` and `lse` named ATTENTION_RESIDUALS, for a policy to save."""
  return checkpoint_name(out, ATTENTION_RESIDUALS), checkpoint_name(lse, ATTENTION_RESIDUALS)
