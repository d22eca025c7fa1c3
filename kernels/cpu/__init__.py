"""C kernels for the CPU backend, compiled on first use with the machine's C compiler."""
