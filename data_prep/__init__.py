"""widedp.data_prep: corpora and interaction logs -> cached id arrays (``cbow``, ``interactions``, ``brown_glm``), with
record-local splits (``splits``). Import the modules themselves: the package imports nothing."""
