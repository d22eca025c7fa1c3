"""Triton kernels, one concept per module; `berth.kernels.triton_ops` is their public face.

The folder is not called `triton/`: run as a script from inside `kernels/`, such a folder would
shadow the real `triton` package.
"""
