"""The search, as pure code: the plan space, Auto search, `codesign plan`'s listing and the
co-design ranking, choosing among the plans the cost model (codesign.cost) prices."""
