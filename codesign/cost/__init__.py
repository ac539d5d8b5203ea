"""The cost model: a plan's time, memory and joules composed from the hardware's answers
(codesign.hardware); the search (codesign.planner) chooses among what it prices. Pure Python."""
