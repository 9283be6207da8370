"""Inference under the recipe's plan: the model prepared for it, the prefill, the decoding engine."""
