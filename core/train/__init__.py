"""One process's training: the model prepared by the plan, the loop, the step, losses, the optimizer."""
