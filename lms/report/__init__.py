"""Presentation: `[LMS]` lines, memory plots, memory-viewer snapshots."""
