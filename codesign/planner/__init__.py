"""From a job to a parallel plan, as pure code: layer groups, stages, placements, schedules.

The engine builds what the planner decided; the cost model prices the same plans.
"""
