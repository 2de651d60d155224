"""Native kernels compiled at run time (``build.py``) and called through ctypes: the paged
decode attention (``paged.py``). Each one is optional: without a C compiler the torch paths run."""
