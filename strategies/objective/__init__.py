"""Training objectives in plain torch: what a step minimises beyond next-token cross-entropy."""
