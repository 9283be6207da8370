"""Model adapters: build a model from a recipe and describe its modules for the rules."""
