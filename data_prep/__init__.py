"""widedp.data_prep: corpora -> cached CBOW id arrays."""

from widedp.data_prep.cbow import CBOWData, Split, prepare_cbow

__all__ = ["CBOWData", "Split", "prepare_cbow"]
