"""Float32-safe losses for low-precision (fp16/bf16) PyTorch training.

The PyTorch twin of `jaxstable.losses`: the same functions and semantics, built
on what a careful PyTorch user already calls (`F.cross_entropy`,
`F.binary_cross_entropy_with_logits`, `torch.sigmoid`) applied to float32
upcasts of the inputs. Inside `torch.autocast` these functions are on the
float32 list anyway, except the matmuls of `info_nce` and
`linear_cross_entropy` (forward and backward), which run with autocast turned
off: every loss returns the same value and gradients inside autocast as
outside it (tested for CPU bfloat16 and float16). The explicit `.float()` also
covers models cast with `.half()` and code outside autocast. Gradients flow
back in the input dtype.

Every loss takes tensors or array-likes: a list or numpy array is converted
with `torch.as_tensor` onto the device of the tensor inputs (as jaxstable
converts with `jnp.asarray`); tensors on different devices raise ValueError
naming each input's device.

Precision, one rule for every loss (jaxstable's too): a loss computes in at
least float32. It computes and returns float32 for bf16, fp16 and float32
predictions, and float64 when its predictions are float64 (the input named in
its docstring's "Precision" line: `logits`, `probs`, `pred`, `prob`/`thresh`,
`a`/`b`, `boxes1`/`boxes2`); targets, masks and weights are cast to that
dtype (jaxstable holds float64 only with x64 on).

Gradients at kinks and ties are those of the PyTorch reference formulas
(`F.binary_cross_entropy_with_logits`: ``sigmoid(x) - t`` at x = 0; `abs`:
0 at 0; `clamp_min`: all of it at the tie; `maximum`/`minimum`: half each),
which jaxstable reproduces; among equal hard negatives the lowest index is
kept (a stable sort, in both twins: `torch.topk`'s choice among ties is
unspecified). Scalar options (eps, temperature, k, ratios, weights) must be
finite; an eps must also be at least float32's smallest normal number.

One module per family, as optax's losses: `cross_entropy`, `binary` (sigmoid
BCE, balanced BCE, dice, focal), `regression` (masked L1), `dbnet` (the step
and the total), `contrastive` (InfoNCE), `boxes` (the IoU family); `_checks`
holds the input checks and reductions they share.
"""
