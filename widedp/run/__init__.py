"""Running a config: the training loop, engines, run directories, budget journal, summaries."""
