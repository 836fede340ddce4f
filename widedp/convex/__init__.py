"""Convex DP algorithms for the ``glm`` task (the founding papers' other algorithms), one module each:

- ``dp_agd``: DP-AGD (Lee & Kifer), zCDP budget, NoisyMax step sizes, gradient averaging.
- ``frank_wolfe``: private variance-reduced Frank-Wolfe on the l1 ball (Bassily, Guzman & Nandi, polyhedral).
- ``output_perturbation``: regularised ERM + noise + l_inf projection (Ghazi et al.); the shared ERM solver.
- ``sparse_mean``: projection mechanism and Gaussian l1 recovery (Ghazi et al.), and the DP-GD loop using them
  (plain Gaussian aggregation = DP-SGD).
- ``numeric_sparse``: NumericSparse and the sparse-gradient ERM loop (Zhang, Mironov & Hejazinia, Alg. 1-2).
- ``common``: spend records (pure / zCDP) -> accountant records, clipping, noise, the result type.
"""
