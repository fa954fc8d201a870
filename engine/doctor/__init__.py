"""`pagedesk-doctor`: is this machine ready to serve on its GPUs? One pass/warn/fail row per fact, each with a
one-line remedy: driver, CUDA, torch and Triton versions, every card (NVML: name, memory, compute
capability, PCIe link), peer-to-peer per pair with its bandwidth, NCCL all-reduce bandwidth, Triton
paged attention compiled and compared with the torch reference on each card, the FP8 KV path, and the
decode speed of a tiny model made on the fly. Without an NVIDIA GPU it says so in one row and passes.
Imports torch, triton and nvidia-ml-py only (the GPU test machine has no Qt or web stack).
"""
