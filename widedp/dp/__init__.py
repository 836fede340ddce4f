"""The DP step and its stages: sampling, per-sample row gradients, clipping, selection, noise."""
