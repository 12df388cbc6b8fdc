"""The core every stage shares: records, the cost model, the save-time policy, the keep rules,
the recomputable ops and the walk that finds gradient junctions.

It imports nothing of `lms` outside this package and never touches `torch.cuda`, so the simulator,
the planners and the runtime can each sit on it without importing one another.
"""
