"""DP convex optimisation algorithms (issue 8)."""
