"""hspmd planner: cost model, ILP/DP search, baselines. May import ``runtime``; never ``hetu_cli``."""
