"""torch.compile policy, warm-up and CUDA-graph capture for the model runner."""
