"""Dry runs of the library's own code at any world size, on one CPU (`shardwise plan
--simulate`): a fake process group in which this process is one rank (fake_group.py), one
training step's structure per strategy on fake tensors (step.py), the checkpoint planner at
scale (checkpoint_plan.py), and the figures `shardwise plan` reports (report.py)."""
