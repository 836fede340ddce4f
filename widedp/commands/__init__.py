"""The commands beside training: ``widedp epsilon`` (``epsilon``), ``widedp export`` (``export``), ``widedp eval``
(``evaluate``; its metric in ``widedp.eval.similarity``), ``widedp compare`` (``compare``, its figures and table in
``compare_plots``). (``widedp canary`` and ``widedp audit`` live in ``widedp.eval``.)"""
