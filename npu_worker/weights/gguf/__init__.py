"""A GGUF file into a Hugging Face-style model directory: reading it (reader.py), its
tensors and config (convert.py) and its tokenizer (tokenizer.py)."""
