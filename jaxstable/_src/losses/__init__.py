"""Float32-safe losses for low-precision (fp16/bf16) JAX training.

Precision, one rule for every loss (and for torchref's twins): a loss computes
in at least float32. It computes and returns float32 for bf16, fp16 and
float32 predictions, and float64 when its predictions are float64 (the input
named in its docstring's "Precision" line: `logits`, `probs`, `pred`,
`prob`/`thresh`, `a`/`b`, `boxes1`/`boxes2`); targets, masks and weights are
cast to that dtype. With x64 off (JAX's default) no array is float64: `jnp.asarray`
has already made a float64 numpy input float32, so the loss is float32 there.
The cross-entropy reads bf16/fp16 logits directly: the cast to float32 is
fused into its reductions and its custom VJP writes the gradient in the
logits' dtype, so no float32 copy of the logits is ever materialised.

Gradients at kinks and ties are those of the PyTorch reference formula
(autograd's conventions, tested against torch): BCE-with-logits' gradient is
``sigmoid(x) - t`` at every logit, 0 included (as torch's
``binary_cross_entropy_with_logits``); ``|d|`` has gradient ``sign(d)``, 0 at
``d = 0`` (torch's ``abs``); a clamp passes the whole gradient at the tie
(torch's ``clamp_min``); ``maximum``/``minimum`` of two equal values give
each half (torch's too); among equal hard negatives the lowest index is kept
(a stable sort, in both twins: ``torch.topk``'s choice among ties is
unspecified).

No bad input gives a finite wrong number: it raises a ValueError/TypeError
naming the value and what is allowed when the inputs are concrete (eager
calls, numpy inputs), and makes the loss NaN when it can only be seen under
`jit` (traced values cannot raise), so a finiteness guard sees it. Scalar
options (eps, temperature, k, ratios, weights) must be finite; an eps must
also be at least float32's smallest normal number. What JAX does before a
loss sees its inputs is documented where it matters: int64 labels under
`jit` (softmax_cross_entropy), subnormal masks (masked_l1_loss).

One module per family, as optax's losses: `cross_entropy`, `binary` (sigmoid
BCE, balanced BCE, dice, focal), `regression` (masked L1), `dbnet` (the step
and the total), `contrastive` (InfoNCE), `boxes` (the IoU family); `_checks`
holds the input checks and reductions they share.
"""
