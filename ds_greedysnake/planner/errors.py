"""The planner's one error type: bad input, with a message naming the value and the fix."""


class PlannerError(ValueError):
    """A model, hardware description or budget the planner cannot plan for."""
