"""Checkpoints on disk: Hugging Face config.json and tensor names, safetensors files, byte ranges
copied file to file, and a rank's slices."""
