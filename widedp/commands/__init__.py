"""The commands beside training: ``widedp epsilon`` (``epsilon``), ``widedp export`` (``export``), ``widedp compare``
(``compare``, its figures in ``compare_plots``). (``widedp canary`` and ``widedp audit`` live in ``widedp.eval``.)"""
