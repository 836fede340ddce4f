"""Execution on several processes: the process group (``ranks``), the ``--nproc`` launcher (``launch``), per-rank
checkpoint shards (``shards``). The row layout of the DP step across ranks is ``widedp.dp.layout.RowBlocks``."""
