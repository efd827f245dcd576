"""Triton's own functions, layered where every launch and compile passes: the seams whose cost every healthy launch
pays and whose every change is read against each Triton release (``TRITON_CHECKED``)."""
