"""Attention algorithms in plain torch: ring, Ulysses, USP, local and segment attention, the vision
tower's Ulysses, decoding over a sharded cache, and their adapter to transformers' attention functions."""
