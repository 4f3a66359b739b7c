"""The CPU backend's kernels: the C library and its build (library.py, kernels.c,
matmul.c), the bfloat16 products (products.py), and the layers that call them (layers.py,
attention.py)."""
