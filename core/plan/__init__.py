"""From a recipe to a Plan and what it predicts: the planner, the memory and time estimate, their views."""
