"""Records to samples to micro-batches: chat formats and templates, images and videos, preprocessing, synthetic
data, token-budget batching and packing."""
