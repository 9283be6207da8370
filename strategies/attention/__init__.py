"""Attention algorithms in plain torch: ring, Ulysses, USP, local and segment attention, the vision
tower's Ulysses, decoding over a sharded cache, and their bridge to transformers' attention functions."""
