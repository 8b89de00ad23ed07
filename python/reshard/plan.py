"""Placeholder: the planner is being written (issue 3)."""


def plan(*args, **kwargs):
    raise NotImplementedError("reshard.plan is being written")


Plan = plan
