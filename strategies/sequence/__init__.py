"""The sequence over the sequence-parallel ranks: the layout (contiguous, zigzag) and the model's split after the
vision merge."""
