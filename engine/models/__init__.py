"""Model definitions written for this engine, and loading them from Hugging Face checkpoints."""
