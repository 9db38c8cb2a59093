"""Tests that need CUDA GPUs (they skip with the reason elsewhere)."""
