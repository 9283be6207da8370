"""Run control: ranks and their launcher, the process group, checkpoints written and resumed, the run lock,
peer and launcher watches, endings, logs."""
