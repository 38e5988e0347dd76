"""What the tests share: the rank runner, the DDP cases and models, the suite guard, the CUDA-graph emulator."""
