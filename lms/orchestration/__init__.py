"""Orchestration: analyze a step, tune a plan for the local device, cache plans, time ops.

Sits on the core, analysis, planning, report and runtime; the runtime reaches it only through
`lms.orchestration.tuning.tune_plan`, imported when `LMS.tune` is called.
"""
