"""The kernel programs (layer 4: programs sit above the libraries they use): the GPU check
(:mod:`~dartree.kernels.tools.gpu_check`), which drives the kernels, the models and the decoding loop on CUDA."""
