"""The code that runs inside Triton's Python stubs; the repository's model.py files are thin shims over it."""
