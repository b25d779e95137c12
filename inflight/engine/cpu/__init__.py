"""C kernels for CPU inference: the source (kernels.c), its build and ctypes binding (kernels.py), and
prepacked linear layers (linear.py)."""
