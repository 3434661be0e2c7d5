"""CUDA on the CPU, for development and CI without a GPU (see README.md beside this file).

`executor` builds the .cu sources with g++ and runs every CUDA thread as a fiber; `cupy_standin` is
the NumPy-backed CuPy subset the backend uses, picked by edgellm.kernels.cuda when
EDGELLM_CUDA_EMULATE=1. Nothing here is imported by the CPU path.
"""
