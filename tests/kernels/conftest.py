"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before
any test imports :mod:`kvbridge.kernels.triton_kernels`. On a GPU machine the
variable is left alone.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
