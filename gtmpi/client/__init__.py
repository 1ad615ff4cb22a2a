"""The user-facing side on rank 0: tensors, creation, free functions, the session."""
