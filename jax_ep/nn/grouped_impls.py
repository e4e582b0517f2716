"""The names of the grouped matmul's implementations (jax_ep.nn.grouped), apart from its code, so
that MoEConfig checks a name without importing the kernels' module."""

IMPLS = ("auto", "xla", "mosaic", "cutlass", "deepgemm")
