"""The cost model's parts, one concern per module; callers use the facade, planner/cost.py ``CostModel``."""
