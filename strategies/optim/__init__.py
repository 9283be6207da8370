"""Optimizer steps and what watches them: stochastic rounding AdamW, gradient norms, update and loss checks."""
