"""What every task shares, in one place; no task is another task's library.

    convert       torch weights into their Flax NNX twin, name by name
    layers_jax    BatchNorm (torch's semantics), ConvBN, Stage, upsample, split / apply
    layers_torch  ConvBN, Stage, upsample: the torch twins
    data          split streams (seeds), smooth noise, NHWC <-> NCHW
    carry_over    a running torchref TrainStep into a jaxstable TrainState and back

The arrows point one way: tasks import `examples.common` and
`examples.harness`; neither imports a task.
"""
