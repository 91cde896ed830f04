"""Writers of small HF-layout safetensors checkpoints (real tensor names, planted structure) for tests."""
