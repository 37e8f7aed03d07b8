"""The target worker: the KV cache pool on the target device, attention backends and the model runner."""
