"""Tensor parallelism over torch.distributed (NCCL on CUDA, gloo on CPU): the process group a model is split over.

- tensor_parallel.py: TensorParallel, one rank's place in its group, and the two collectives a split model needs
"""
