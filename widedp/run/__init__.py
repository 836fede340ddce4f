"""Running a config: the training loop (``loop``, ``train``), its trainers (``trainers``: one step of each kind),
the privacy plan (``plan``), the run directory (``rundir``), checkpoints (``checkpoint``), the spent-budget journal
(``journal``), summaries and plots (``summary``, ``plots``)."""
