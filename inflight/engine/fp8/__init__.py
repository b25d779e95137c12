"""Float8 (e4m3) weights: one float32 scale per output channel.

weights.py holds the format (Fp8Weight, quantization at load, Fp8Linear); linear.py the products (CUDA:
torch._scaled_mm on FP8 tensor cores, a Triton kernel on older GPUs; elsewhere the weight dequantized per
call); triton_kernels.py the Triton kernel; checkpoint.py reads FP8 checkpoints as released on the Hugging
Face hub.
"""
