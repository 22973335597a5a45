"""GRPO recipes and the embedded tiny default (model, tokenizer, task)."""
