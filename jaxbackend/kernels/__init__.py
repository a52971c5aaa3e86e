"""Hand-written accelerator kernels (Pallas) for the lowering's hottest ops.

Each kernel module holds one kernel, its VJP and the predicate that says when it is chosen; the ops in
``jaxbackend.ops`` call them on GPUs and keep their portable lowering elsewhere. On the CPU the kernels run in
Pallas's interpret mode, which is how the tests check their values and gradients.
"""
