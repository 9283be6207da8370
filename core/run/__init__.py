"""Run control: ranks and their launcher, checkpoints, the run lock, peer and launcher watches, endings, logs."""
